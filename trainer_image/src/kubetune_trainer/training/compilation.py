"""Regional torch.compile: each repeated block of the trained model compiled in place.

A denoiser is a stack of identical blocks (a UNet's transformer blocks, a DiT's double and single
blocks). Compiling one block class and reusing it for every instance takes a fraction of the time
of compiling the whole model, and fuses what costs the most at small batch: the launch overhead of
the many small element-wise ops (LoRA's among them). Blocks are compiled with `Module.compile`, in
place, so parameter names, state dicts, checkpoints and LoRA files are those of the eager model,
and DDP or FSDP2 wrap the model as before (FSDP's hooks stay outside the compiled code).

Shapes: every bucket (resolution and aspect ratio) is a shape of its own. Blocks compile with
static shapes and dynamo keeps one graph per shape (the recompile limit is raised to the run's
number of shapes), so each bucket compiles once and then runs its own specialised kernels.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

log = logging.getLogger("kubetune.trainer")

# spec.training.compileMode -> torch.compile's mode (None: its default).
MODES = {"default": None, "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
         "reduce-overhead": "reduce-overhead"}
# Graphs kept per compiled block beyond the run's shapes: training and no-grad (validation) forms,
# and a last micro-batch of another size.
SPARE_GRAPHS = 8


@dataclass(frozen=True)
class CompiledRegions:
    blocks: Counter        # block class name -> instances compiled
    mode: str

    def describe(self) -> str:
        kinds = ", ".join(f"{count} {name}" for name, count in self.blocks.most_common())
        return f"{kinds} (mode {self.mode})"


def repeated_block_names(module: torch.nn.Module) -> list[str]:
    """The class names of the model's repeated blocks: what diffusers models declare as
    `_repeated_blocks` (for regional compilation), else the blocks a model declares unsplittable
    (`_no_split_modules`, transformers and diffusers alike), else none.

    Measured on an H200 (benchmarks/RESULTS.md): SD1.5's 16 transformer blocks compile in 33 s and
    make a batch-1 step 22% faster; adding its ResNet and up blocks (their _no_split_modules) took
    over 170 s to compile, unmeasured beyond that, so a UNet's ResNet blocks stay eager."""
    for attribute in ("_repeated_blocks", "_no_split_modules"):
        names = [name for sub in module.modules() for name in (getattr(sub, attribute, None) or ())]
        if names:
            return list(dict.fromkeys(names))
    return []


def compile_regions(module: torch.nn.Module, mode: str, shapes: int = 1) -> CompiledRegions:
    """Compile every instance of the model's repeated blocks in place (the whole model when it has
    none); `shapes`: how many input shapes the run feeds (buckets), each compiled once."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes + SPARE_GRAPHS)
    names = set(repeated_block_names(module))
    blocks = [sub for sub in module.modules() if type(sub).__name__ in names and sub is not module]
    # A block nested in another block is compiled as part of the outer one.
    outer = [block for block in blocks if not any(other is not block and _contains(other, block) for other in blocks)]
    for block in outer or [module]:
        block.compile(mode=MODES[mode], dynamic=False)
    return CompiledRegions(Counter(type(block).__name__ for block in outer or [module]), mode)


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(sub is inner for sub in outer.modules())


class CompileTimer:
    """Says how long compilation took, once the first step (where it happens) is done: dynamo's and
    inductor's own time, read from torch's compile metrics, beside the step's wall time."""

    def __init__(self, regions: CompiledRegions | None):
        self.regions = regions
        self._started: float | None = None

    def step_started(self) -> None:
        if self.regions is not None and self._started is None:
            self._started = time.perf_counter()

    def step_done(self) -> str | None:
        """The log line after the first compiled step (None otherwise, and on later calls)."""
        if self.regions is None or self._started is None:
            return None
        regions, self.regions = self.regions, None
        step = time.perf_counter() - self._started
        return (f"torch.compile: {regions.describe()} compiled in {compile_seconds():.1f} s "
                f"(the first step took {step:.1f} s)")


# torch's compile-time metrics that add up to the whole: dynamo's entry point (tracing, the forward's
# inductor code generation) and the backward graph, which AOT autograd compiles at the first backward.
COMPILE_METRICS = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> float:
    """Seconds torch has spent compiling in this process, from its own timing metrics."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(name, ())) for name in COMPILE_METRICS)
