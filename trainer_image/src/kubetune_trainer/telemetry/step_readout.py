"""What the host learns from each step — its loss, whether any process was asked to stop, each
process's GPU memory — read one step late, so the GPU is never left idle waiting for the host.

Reading a number computed on the GPU (`loss.item()`) blocks the host until the GPU has run
everything queued before it: the host then has nothing queued for the next step while it loads the
batch and launches the next forward, and the GPU idles for that long every step. Instead, each
step's numbers are packed into one small device tensor, gathered across processes by one
collective queued behind the step, and read after the next step has been queued: by then the GPU
has long finished the older step, and reading it waits for nothing.

A step's numbers are read at once (drain) where the run needs them before going on: at a
checkpoint (the manifest records the loss, and a diverged step must never be saved), a validation,
the last step, and where the learning-rate schedule reacts to each training loss. Every process
reads the same steps at the same points (the points depend on step numbers only), so a stop
request or a non-finite loss seen in a step is acted on by every process together, one step later
at most.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from kubetune_trainer.training.device_copy import to_device


@dataclass(frozen=True)
class StepResult:
    step: int                          # the step's number (1-based: steps done after it)
    epoch: int
    lr: float
    ended: float                       # time.time() when the host had queued the whole step
    loss: float                        # the mean loss over every process's samples
    stop_requested: bool               # some process had been asked to stop when the step ended
    memory: list[tuple[int, int]]      # per process: GPU bytes allocated, reserved (0, 0 off a GPU)


@dataclass(frozen=True)
class _Queued:
    step: int
    epoch: int
    lr: float
    ended: float
    rows: torch.Tensor                 # [processes, 4]: loss sum, stop flag, memory allocated, reserved


class StepReadout:
    """Queues each step's numbers and hands them back, in order, once they can be read without waiting."""

    def __init__(self, device: torch.device, global_batch: int, gather):
        self.device, self.global_batch = device, global_batch
        self._gather = gather  # [1, k] tensor -> [processes, k], a collective (identity for one process)
        self._queued: deque[_Queued] = deque()

    def push(self, step: int, epoch: int, lr: float, loss_sum: torch.Tensor, stop_requested: bool) -> None:
        """Queue step `step`'s numbers: `loss_sum` is this process's sum over its samples (on the device)."""
        memory = ((torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
                  if self.device.type == "cuda" else (0, 0))
        host = torch.tensor([float(stop_requested), *memory], dtype=torch.float64)
        row = torch.cat([loss_sum.detach().to(torch.float64).reshape(1), to_device(host, self.device)])
        self._queued.append(_Queued(step, epoch, lr, time.time(), self._gather(row[None])))

    def read(self, drain: bool = False) -> list[StepResult]:
        """The queued steps whose numbers are ready: all but the newest, or every one with `drain`."""
        keep = 0 if drain else 1
        results = []
        while len(self._queued) > keep:
            queued = self._queued.popleft()
            rows = queued.rows.tolist()
            results.append(StepResult(
                queued.step, queued.epoch, queued.lr, queued.ended,
                loss=sum(row[0] for row in rows) / self.global_batch,
                stop_requested=any(row[1] for row in rows),
                memory=[(int(row[2]), int(row[3])) for row in rows]))
        return results
