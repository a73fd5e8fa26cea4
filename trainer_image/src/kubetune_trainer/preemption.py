"""Stopping for preemption: SIGTERM (spot reclaim, eviction, Kueue suspend, pod deletion).

The handler only records the request; the loop acts on it at the next step boundary, where all
processes agree (a collective), save one last checkpoint together and exit with 143 — 128 +
SIGTERM, a code the PyTorchJob ExitCode restart policy treats as retryable.
"""
from __future__ import annotations

import signal
import threading

RETRYABLE_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
    """Raised after the last checkpoint was written; the run should exit with RETRYABLE_EXIT_CODE."""

    def __init__(self, step: int):
        super().__init__(f"stopped by SIGTERM after step {step}; the last checkpoint holds it")
        self.step = step


class StopRequest:
    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self) -> "StopRequest":
        signal.signal(signal.SIGTERM, lambda signum, frame: self._event.set())
        return self

    def requested(self) -> bool:
        return self._event.is_set()

# How long a stopping run waits for its queued uploads: the operator's pods get
# terminationGracePeriodSeconds 120, and saving the last checkpoint comes first.
PREEMPTION_UPLOAD_SECONDS = 90
