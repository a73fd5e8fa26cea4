"""The profiling switch: a torch profiler trace of a few optimizer steps, for TensorBoard or Perfetto."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch


@contextmanager
def _profiling(optimizer: torch.optim.Optimizer, steps: int, out_dir: Path):
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(str(out_dir)), record_shapes=True) as profiler:
        # The profiler advances per optimizer step; the loop needs to know nothing about it.
        inner = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
        handle = inner.register_step_post_hook(lambda *_: profiler.step())
        try:
            yield profiler
        finally:
            handle.remove()


def maybe_profile(optimizer: torch.optim.Optimizer, steps: int | None, out_dir: Path, enabled: bool):
    """Profile `steps` optimizer steps after one warm-up step on this process, or do nothing."""
    if not steps or not enabled:
        return nullcontext()
    out_dir.mkdir(parents=True, exist_ok=True)
    return _profiling(optimizer, steps, out_dir)
