"""One background thread that uploads, so training never waits for the network.

Tasks run one at a time in submission order (a checkpoint's manifest after its files, run.json
after the checkpoint it mentions). A task that fails is retried with growing pauses until it
succeeds or `give_up_seconds` pass: an S3 endpoint that is down for a minute costs no training
time, only a later upload. A queued checkpoint that a newer one supersedes before its upload
starts is skipped (the newer one is what a resume wants).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


@dataclass
class Task:
    name: str  # for log lines: "checkpoint-40", "final weights"
    work: Callable[[], None]
    on_done: Callable[[float], None] = lambda seconds: None  # seconds from the first attempt, retries included
    on_skipped: Callable[[], None] = lambda: None
    supersedable: bool = False  # a newer supersedable task of the same group replaces this one while it waits
    group: str = ""
    required: bool = False  # flush() fails when this one gave up
    if_superseded: "Task | None" = None  # runs in this one's place when it is superseded (a note for readers)


class UploadFailed(RuntimeError):
    pass


class BackgroundUploader:
    def __init__(self, give_up_seconds: float = 1800, max_pause_seconds: float = 15,
                 on_pending: Callable[[int], None] = lambda count: None):
        self.give_up_seconds = give_up_seconds
        self.max_pause_seconds = max_pause_seconds
        self.on_pending = on_pending
        self._queue: deque[Task] = deque()
        self._busy = False
        self._failed: list[str] = []
        self._closed = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kubetune-uploader", daemon=True)
        self._thread.start()

    def submit(self, task: Task) -> None:
        with self._condition:
            if task.supersedable:
                for index, waiting in reversed(list(enumerate(self._queue))):
                    if not (waiting.supersedable and waiting.group == task.group):
                        continue
                    del self._queue[index]
                    if waiting.if_superseded is not None:
                        self._queue.insert(index, waiting.if_superseded)
                    log.info("not uploading %s: %s is newer", waiting.name, task.name)
                    waiting.on_skipped()
            self._queue.append(task)
            self._report_pending()
            self._condition.notify_all()

    def pending(self) -> int:
        with self._condition:
            return len(self._queue) + self._busy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted task is done; False on timeout. Raises if a required one gave up."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._condition.wait(left)
            failed, self._failed = self._failed, []
        if failed:
            raise UploadFailed(f"gave up uploading {', '.join(failed)} after {self.give_up_seconds:.0f} s of retries")
        return True

    def close(self, wait: bool = True) -> None:
        """Stop the thread once the queue is empty (flush first to know how that went); with
        wait=False return at once (the daemon thread ends with the process)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if wait:
            self._thread.join()

    def _report_pending(self) -> None:
        self.on_pending(len(self._queue) + self._busy)

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._closed:
                    self._condition.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
                self._busy = True
            ok = self._attempt_until_done(task)
            with self._condition:
                self._busy = False
                if not ok and task.required:
                    self._failed.append(task.name)
                self._report_pending()
                self._condition.notify_all()

    def _attempt_until_done(self, task: Task) -> bool:
        started, pause, attempt = time.monotonic(), 1.0, 1
        while True:
            try:
                task.work()
            except Exception as err:  # noqa: BLE001 - any failure is retried; the log says which
                waited = time.monotonic() - started
                if waited + pause > self.give_up_seconds:
                    log.error("giving up uploading %s after %d attempts: %s", task.name, attempt, err)
                    return False
                log.warning("uploading %s failed (attempt %d: %s); retrying in %.0f s", task.name, attempt,
                            err, pause)
                time.sleep(pause)
                pause, attempt = min(pause * 2, self.max_pause_seconds), attempt + 1
                continue
            task.on_done(time.monotonic() - started)
            return True
