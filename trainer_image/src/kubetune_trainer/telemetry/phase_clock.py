"""How long each phase of a training step took (data wait, forward/backward, optimizer), without
stalling the GPU to find out.

The GPU runs what the CPU queues asynchronously, so CPU timestamps charge a forward pass to
whichever phase happens to wait for the device next. Synchronising at every mark fixes that but
drains the queue the GPU needs to stay busy, once per micro-batch. On CUDA this clock records an
event on the stream at each mark instead and reads the time between two events only once the GPU
has passed both (`event.query()`, which does not wait). Phases are then measured on the GPU's own
timeline: data wait is the time the device sat without new work, and the phases still add up to
the elapsed time. A few steps' worth of marks may wait to be charged; `flush()` charges them all.

On the CPU (and on ranks that do not report) `time.perf_counter` marks are exact and cheap.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional, Protocol

import torch

# Marks waiting for the GPU before the clock waits for the oldest one. The training loop reads the
# loss every optimizer step (a sync), so in practice the queue holds about one step's marks and this
# bound only matters for long accumulation; the oldest event is then long done.
MAX_PENDING = 64


class TimingEvent(Protocol):
    """The part of torch.cuda.Event the clock uses (tests pass fakes)."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: "TimingEvent") -> float: ...  # milliseconds


def _cuda_timing_event() -> TimingEvent:
    return torch.cuda.Event(enable_timing=True)


class PhaseClock:
    """Charges the time since the previous mark to the phase that just ended (`reporter.phase`)."""

    def __init__(self, reporter, device: torch.device,
                 new_event: Callable[[], TimingEvent] = _cuda_timing_event, max_pending: int = MAX_PENDING):
        self._charge = reporter.phase
        # Only the reporting rank's numbers are shown; elsewhere reporter.phase is a no-op and the
        # CPU clock costs nothing.
        self._on_gpu = device.type == "cuda" and reporter.enabled
        self._last = time.perf_counter()
        self._new_event = new_event
        self._max_pending = max_pending
        # (phase, event) in stream order; phase None = a restart: the time up to it is not charged.
        self._pending: deque[tuple[Optional[str], TimingEvent]] = deque()
        self._spare: list[TimingEvent] = []  # resolved events, recorded again instead of created
        self._anchor = self._record() if self._on_gpu else None  # the last event already accounted for

    def mark(self, phase: str) -> None:
        """The phase `phase` ends now."""
        if not self._on_gpu:
            now = time.perf_counter()
            self._charge(phase, now - self._last)
            self._last = now
            return
        self._pending.append((phase, self._record()))
        self._settle()

    def restart(self) -> None:
        """Forget the time since the last mark (it was charged elsewhere, e.g. to checkpointing)."""
        if not self._on_gpu:
            self._last = time.perf_counter()
            return
        self._pending.append((None, self._record()))
        self._settle()

    def flush(self) -> None:
        """Charge every mark so far, waiting for the GPU to reach the last one (e.g. at the end of a run)."""
        if self._pending:
            self._pending[-1][1].synchronize()
        self._resolve()

    # --- on the GPU ---------------------------------------------------------------------------

    def _record(self) -> TimingEvent:
        event = self._spare.pop() if self._spare else self._new_event()
        event.record()
        return event

    def _settle(self) -> None:
        self._resolve()
        while len(self._pending) > self._max_pending:
            self._pending[0][1].synchronize()  # waits for the oldest mark only, not the whole queue
            self._resolve()

    def _resolve(self) -> None:
        """Charge the marks the GPU has passed; events complete in stream order, so stop at the first that has not."""
        while self._pending and self._pending[0][1].query():
            phase, event = self._pending.popleft()
            if phase is not None:
                self._charge(phase, self._anchor.elapsed_time(event) / 1000.0)
            self._spare.append(self._anchor)
            self._anchor = event
