"""Stopping for preemption: SIGTERM (spot reclaim, eviction, Kueue suspend, pod deletion) or SIGINT.

Before training starts (loading models, filling the cache) a stop request ends the process at
once: nothing is worth saving yet. Once the training loop runs, the handler only records the
request; the loop acts on it at the next step boundary, where all processes agree (a
collective), save one last checkpoint together and exit with 143 — 128 + SIGTERM, a code the
PyTorchJob ExitCode restart policy treats as retryable.
"""
from __future__ import annotations

import signal

from kubetune_api.contract import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PREEMPTED

# The trainer's names for the contract's exit codes (the backends' restart policies read them).
RETRYABLE_EXIT_CODE = EXIT_PREEMPTED
CONFIG_ERROR_EXIT_CODE = EXIT_BAD_INPUT
DIVERGED_EXIT_CODE = EXIT_DIVERGED

# How long a stopping run waits for its queued uploads: the operator's pods get
# terminationGracePeriodSeconds 120, and saving the last checkpoint comes first.
PREEMPTION_UPLOAD_SECONDS = 90

# What a collective raises when a process on the other end is gone (gloo reports it as a
# RuntimeError from its TCP transport; NCCL and the rendezvous store raise DistError subclasses).
_LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "Socket Timeout", "connection refused")


class Preempted(Exception):
    """Raised when a stop request ends the run; the process should exit with RETRYABLE_EXIT_CODE."""

    def __init__(self, step: int | None, cause: str = "SIGTERM"):
        where = (f"after step {step}; the last checkpoint holds it" if step is not None
                 else "before training started; nothing to save yet")
        super().__init__(f"stopped by {cause} {where}")
        self.step = step


class StopRequest:
    """Records SIGTERM/SIGINT; raises Preempted at once until `defer()` (the loop checks `requested`).

    The handler only assigns attributes and takes no lock: a pod's processes often get SIGTERM
    twice within microseconds (the runtime signals the container's process group and the launcher
    forwards its own), and a second handler run while the first held a lock — as
    `threading.Event.set` does — deadlocked the main thread until SIGKILL.
    """

    def __init__(self) -> None:
        self._requested = False
        self._deferred = False
        self.signal_name = "SIGTERM"

    def install(self) -> "StopRequest":
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def uninstall(self) -> None:
        """Give the signals back (a run inside a longer-lived process, e.g. `kubetune train`)."""
        for sig, handler in getattr(self, "_previous", {}).items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        if self._requested:
            return  # a repeat (the group's and the launcher's SIGTERM): raising again would break the exit path
        self.signal_name = signal.Signals(signum).name
        self._requested = True
        if not self._deferred:
            raise Preempted(None, self.signal_name)

    def check(self) -> None:
        """Raise Preempted if a stop was requested: the handler's own raise can be swallowed (e.g.
        by logging, which catches whatever happens while it writes), so phases check too."""
        if self._requested:
            raise Preempted(None, self.signal_name)

    def defer(self) -> None:
        """From now on a stop waits for the step boundary; a request that came already still counts."""
        self._deferred = True

    def requested(self) -> bool:
        return self._requested

    def cause(self) -> str:
        """Why this process stops at an agreed step: its own signal, or another process's."""
        return self.signal_name if self.requested() else "another process's stop request (SIGTERM)"


def is_lost_peer(error: BaseException) -> bool:
    """Whether a failed collective means another process of the job is gone (not a bug here)."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(sign.lower() in str(error).lower() for sign in _LOST_PEER_SIGNS)
