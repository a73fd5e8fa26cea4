"""S3 goes away for 30 s while a run uploads checkpoints: training goes on, uploads catch up,
and nobody listing the bucket ever sees a checkpoint with files missing."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time

import pytest

from kubetune_trainer.storage import s3
from kubetune_trainer.checkpoint.store import complete_steps
from kubetune_trainer.storage.uri import parse_s3
from tests.storage.conftest import new_bucket
from tests.trainer.conftest import (captions_data, tiny_job, tiny_sd15, trainer_command,  # noqa: F401 (fixtures)
                                    trainer_env, write_manifest)

pytestmark = pytest.mark.slow
OUTAGE_SECONDS = 30


class StepWatcher:
    """Follows the trainer's log for the latest step (and keeps the log for failure messages)."""

    def __init__(self, stream):
        self.step, self.lines = 0, []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line)
            if found := re.search(r"step (\d+)/", line):
                self.step = int(found.group(1))

    def finish(self) -> None:
        self._thread.join(timeout=30)  # the process exited: read what is left in the pipe

    def log(self) -> str:
        return "".join(self.lines[-40:])


def incomplete_listed(run) -> list[str]:
    """Checkpoints that look complete (manifest listed) but whose files are not all there."""
    objects = s3.list_objects(run)
    problems = []
    for step in complete_steps(objects):
        text = s3.read_text(run.child(f"checkpoint-{step}", "manifest.json"))
        if text is None:
            continue  # pruned since the listing: its manifest goes first, so it was never half-visible
        for name, entry in json.loads(text)["files"].items():
            if objects.get(f"checkpoint-{step}/{name}") != entry["size"]:
                problems.append(f"checkpoint-{step}/{name}")
    return problems


def wait_for(condition, timeout: float, what: str, log=lambda: ""):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{log()}"
        time.sleep(0.2)


def test_training_continues_through_an_s3_outage_and_uploads_complete_after(own_s3_server, request, tiny_job,
                                                                            tmp_path):
    bucket = new_bucket(request)
    manifest = tiny_job(maxSteps=1_000_000, logEverySteps=1)
    manifest["spec"]["checkpoints"].update(uri=f"s3://{bucket}/runs", everySteps=2, keepLast=2)
    env = {**trainer_env(), "KUBETUNE_STAGING_DIR": str(tmp_path / "staging")}
    trainer = subprocess.Popen(trainer_command(write_manifest(manifest, tmp_path)), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watcher = StepWatcher(trainer.stderr)
    run = parse_s3(f"s3://{bucket}/runs/default/tiny/v0")
    seen_bad = []  # every poll of the bucket checks that what looks complete is complete

    def uploaded_at_least(step: int):
        def check():
            seen_bad.extend(incomplete_listed(run))
            return max(complete_steps(s3.list_objects(run)), default=0) >= step
        return check

    try:
        wait_for(uploaded_at_least(1), 300, "the first uploaded checkpoint", watcher.log)

        own_s3_server.stop()
        stopped_at = watcher.step
        time.sleep(OUTAGE_SECONDS)
        during = watcher.step - stopped_at
        assert trainer.poll() is None, watcher.log()
        assert during >= 5, f"training went on without S3 ({during} steps in {OUTAGE_SECONDS} s)"
        assert any("failed (attempt" in line for line in watcher.lines), "an upload met the outage and was retried"

        own_s3_server.start()
        s3.forget_clients()
        resumed_at = watcher.step
        wait_for(uploaded_at_least(resumed_at), 180, f"a checkpoint from after the outage (step {resumed_at})",
                 watcher.log)
        # The logs' mirror is queued right after the checkpoint it follows: give it its turn.
        wait_for(lambda: any(k.startswith("logs/events.out.tfevents") for k in s3.list_objects(run)), 60,
                 "TensorBoard logs in S3 while the run goes on (they follow the checkpoints)", watcher.log)
    finally:
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(timeout=180)
        watcher.finish()
    assert trainer.returncode == 143, watcher.log()
    last = int(re.search(r"stopped by SIGTERM after step (\d+)", watcher.log()).group(1))
    assert max(complete_steps(s3.list_objects(run))) == last, "the SIGTERM checkpoint was uploaded before exit"
    seen_bad.extend(incomplete_listed(run))
    assert not seen_bad, f"listed before all their files were there: {seen_bad}"
