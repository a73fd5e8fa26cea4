"""Background processes that outlive the command that started them, tracked by pid file.

A pid file holds the pid and the process's start time (from /proc/PID/stat). A pid is only
trusted, and only ever signalled, when both still match: a recycled pid never gets a signal.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def start_time(pid: int) -> int | None:
    """Clock ticks since boot at which PID started, or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (comm) may contain spaces; fields after the closing parenthesis are plain.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie has exited already
        return None
    return int(fields[19])


@dataclass(frozen=True)
class Recorded:
    """A process we started: its pid and start time, as written to its pid file."""

    pid: int
    started: int

    def alive(self) -> bool:
        return start_time(self.pid) == self.started

    def signal_group(self, sig: int) -> None:
        """Signal the process group we created for it (its own children included)."""
        if self.alive():
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass


def record(pid: int, pid_file: Path) -> Recorded:
    started = start_time(pid)
    if started is None:
        raise RuntimeError(f"process {pid} exited right after it started")
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(json.dumps({"pid": pid, "started": started}))
    return Recorded(pid, started)


def read(pid_file: Path) -> Recorded | None:
    try:
        data = json.loads(pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return Recorded(data["pid"], data["started"])


def running(pid_file: Path) -> Recorded | None:
    """The recorded process when it is still the one we started, else None."""
    proc = read(pid_file)
    return proc if proc and proc.alive() else None


def spawn(argv: list[str], log_file: Path, pid_file: Path, *, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> Recorded:
    """Start ARGV detached (own session, so it survives us and can be stopped as a group)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
    return record(proc.pid, pid_file)


def stop(proc: Recorded, grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it outlives GRACE seconds."""
    proc.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while proc.alive() and time.monotonic() < deadline:
        _reap(proc.pid)
        time.sleep(0.1)
    proc.signal_group(signal.SIGKILL)
    while proc.alive():
        time.sleep(0.05)
    _reap(proc.pid)


def _reap(pid: int) -> None:
    """Collect the exit status when PID is our own child, so no zombie stays behind."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
