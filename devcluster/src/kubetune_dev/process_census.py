"""Every Python process of a measured test run says when it started, what it ran, how long its imports
took and how much CPU it used (kubetune_dev.test_time reads what they write).

Loaded at interpreter start-up by a `.pth` line that `benchmarks/test_time.py` puts into the virtualenv
for the length of one measured run, and removes after it: a pod's environment is the pod's own, so an
environment variable would not reach the trainer processes the process kubelet starts, but every one of
them runs this virtualenv's interpreter. Without that line nothing here is imported.

Import time is the time spent inside outermost `import` statements (builtins.__import__ at depth 0),
as wall and as CPU seconds: it is what a pre-imported interpreter would save (the wall grows with the
machine's load, the CPU does not). Each process appends JSON lines to its own file
`<records>/procs/<pid>.jsonl`: one when it starts, one when it exits normally (atexit; a process killed
by a signal it does not handle leaves only the first). A forked child (os.fork, a DataLoader worker)
starts a record of its own with no import time of its own.
"""
from __future__ import annotations

import atexit
import builtins
import json
import os
import sys
import time

_state = {"records": None, "depth": 0, "import_s": 0.0, "import_cpu_s": 0.0, "start": 0.0, "forked": False}


def _write(line: dict) -> None:
    try:
        with open(os.path.join(_state["records"], "procs", f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(line) + "\n")
    except OSError:
        pass  # a sandboxed pod that cannot see the records folder: counted as unrecorded, not broken


def _timed_import(*args, **kwargs):
    if _state["depth"]:
        return _original_import(*args, **kwargs)
    _state["depth"] = 1
    started, cpu = time.perf_counter(), time.process_time()
    try:
        return _original_import(*args, **kwargs)
    finally:
        _state["import_s"] += time.perf_counter() - started
        _state["import_cpu_s"] += time.process_time() - cpu
        _state["depth"] = 0


def _started() -> None:
    _state["start"] = time.time()
    _write({"event": "start", "pid": os.getpid(), "ppid": os.getppid(), "time": _state["start"],
            "argv": sys.orig_argv[1:][:12], "worker": os.environ.get("PYTEST_XDIST_WORKER"),
            "forked": _state["forked"]})


def _exited() -> None:
    user, system = os.times()[:2]
    _write({"event": "exit", "pid": os.getpid(), "time": time.time(), "cpu_s": round(user + system, 3),
            "import_s": round(_state["import_s"], 3), "import_cpu_s": round(_state["import_cpu_s"], 3),
            "modules": len(sys.modules)})


def _after_fork() -> None:
    _state.update(forked=True, import_s=0.0, import_cpu_s=0.0, depth=0)
    _started()


_original_import = builtins.__import__


def _descends_from(root: int) -> bool:
    """Whether `root` is this process's parent, grandparent...: only the measured run's processes are
    recorded, not whatever else this virtualenv runs meanwhile."""
    pid = os.getpid()
    while pid > 1:
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def install(records: str, root: int) -> None:
    """Start recording this process if the run that started at pid `root` started it (called from the
    .pth line with the records folder and the measuring script's pid)."""
    if _state["records"] is not None or not _descends_from(root):
        return
    _state["records"] = records
    builtins.__import__ = _timed_import
    os.register_at_fork(after_in_child=_after_fork)
    atexit.register(_exited)
    _started()
