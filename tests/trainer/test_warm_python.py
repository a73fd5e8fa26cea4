"""The test suite's fork server (tests/warm_python.py) keeps what the tests it serves rely on: a process it
forks starts its trainer processes (kubetune_trainer.process.spawn) forked from the server too, which
behave as subprocess.Popen does for the launcher and `kubetune sweep`, and die with their launcher.

This module is also the probe those processes run: `python -m tests.trainer.test_warm_python ROLE`."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from tests import warm_python  # imports nothing heavy: the probe's own start is what it reports

PROBE = [sys.executable, "-m", "tests.trainer.test_warm_python"]


READY = "KUBETUNE_PROBE_READY"  # where the child says it runs (KUBETUNE_: read at run time, so still forked)


def start_child():
    """spawn.start the child, wait until it runs; (the Popen-like process, what the child said of itself)."""
    import tempfile
    from pathlib import Path

    from kubetune_trainer.process import spawn

    ready = Path(tempfile.mkdtemp()) / "ready.json"
    child = spawn.start([*PROBE, "child"], {**os.environ, READY: str(ready)})
    running = child.poll()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, {**json.loads(ready.read_text()), "running": running}


def start_and_signal_a_child() -> None:
    """As a launcher: start a child, stop it with SIGTERM, report what Popen's calls said."""
    child, said = start_child()
    child.send_signal(signal.SIGTERM)
    print(json.dumps({**said, "kind": type(child).__name__, "pid": child.pid,
                      "returncode": child.wait(timeout=30), "poll": child.poll()}), flush=True)


def start_a_child_then_die() -> None:
    """As a launcher killed outright: start a child, name it, SIGKILL itself."""
    child, _ = start_child()
    print(json.dumps({"pid": child.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def child() -> None:
    """Say whether this process started with torch already imported (forked), then wait to be stopped."""
    said = json.dumps({"child": os.getpid(), "torch_at_start": "torch" in sys.modules})
    with open(os.environ[READY] + ".tmp", "w") as out:
        out.write(said)
    os.rename(os.environ[READY] + ".tmp", os.environ[READY])
    time.sleep(120)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def trainer_env() -> dict[str, str]:
    """The environment the server was started with: a request in it is always forked, whatever an earlier test
    of this worker left in os.environ (which would send trainer_env()'s requests to a fresh interpreter)."""
    return dict(warm_python.SERVER_ENV)


def test_a_forked_process_starts_its_children_forked_too_and_signals_and_waits_for_them_as_popen_does():
    result = warm_python.run([*PROBE, "signal"], env=trainer_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["kind"] == "WarmProcess" and report["torch_at_start"], "forked from the pre-imported server"
    assert report["child"] == report["pid"], "the pid the launcher signals is the child's own"
    assert report["running"] is None and report["returncode"] == report["poll"] == -signal.SIGTERM


def test_a_forked_process_s_children_die_with_it():
    result = warm_python.run([*PROBE, "die"], env=trainer_env(), timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    pid = json.loads(result.stdout.splitlines()[0])["pid"]
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the keeper killed the child when its launcher's connection closed"


def test_a_launcher_started_by_subprocess_starts_its_children_as_users_launchers_do():
    import subprocess

    result = subprocess.run([*PROBE, "signal"], env=trainer_env(), cwd=warm_python.REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["kind"] == "Popen" and not report["torch_at_start"], "a fresh interpreter"
    assert report["returncode"] == -signal.SIGTERM


if __name__ == "__main__":
    {"signal": start_and_signal_a_child, "die": start_a_child_then_die, "child": child}[sys.argv[1]]()
