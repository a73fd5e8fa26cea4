"""No trainer process outlives its launcher.

The launcher (kubetune_trainer.process.launcher: `kubetune train --nproc N`, or a pod's main process)
passes SIGTERM and Ctrl-C on to its workers; but a launcher killed with SIGKILL (the OOM killer,
`kill -9`, a closed terminal's session ending badly) cannot, and its workers would train on as
orphans, holding the GPUs and writing into the run. So each worker asks the kernel for SIGTERM
when its parent dies (Linux's prctl(PR_SET_PDEATHSIG), set through ctypes: no thread, no polling,
and delivered however busy the worker is), and treats it as any stop: a last checkpoint, exit
143. Elsewhere (macOS has no PDEATHSIG) a daemon thread polls the parent's pid once a second.

The launcher names itself in KUBETUNE_LAUNCHER_PID. A worker whose parent is already not that
pid (the launcher died between fork and this call) stops at once, which closes the race PDEATHSIG
alone leaves open.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_VARIABLE = "KUBETUNE_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
POLL_SECONDS = 1.0


def watch_launcher() -> None:
    """Stop this process (SIGTERM to itself) when the launcher that started it dies."""
    expected = os.environ.pop(LAUNCHER_PID_VARIABLE, None)  # for this process only, not what it starts
    if not expected or not expected.isascii() or not expected.isdigit():
        return  # started by hand, or the single process of `kubetune train`: nothing to watch
    launcher = int(expected)
    if not (sys.platform.startswith("linux") and _ask_kernel(signal.SIGTERM)):
        threading.Thread(target=_poll_parent, args=(launcher,), name="kubetune-parent-watch", daemon=True).start()
    if os.getppid() != launcher:  # it died before the kernel was asked
        os.kill(os.getpid(), signal.SIGTERM)


def _ask_kernel(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _poll_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)
