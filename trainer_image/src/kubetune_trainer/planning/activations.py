"""Activation memory of one training forward: the bytes autograd keeps for backward.

Every tensor an op saves for backward passes through `saved_tensors_hooks`; counting each
storage once (views of one tensor share it) and leaving out the parameters (counted as
weights) gives what stays allocated from the end of the forward pass into backward, the
step's peak. Gradient checkpointing replaces a block's saved tensors by its inputs (torch's own
hooks take over inside the block, so ours only see what the checkpoint keeps); backward then
rebuilds one block at a time, which `checkpointed_blocks` measures by running each block once
more under a meter of its own.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


VIEWS = {"TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0",
         "ExpandBackward0", "AliasBackward0"}


def is_parameter_cast(tensor: torch.Tensor) -> bool:
    """A (view of a) low-precision copy of a trained parameter that autocast made: its gradient
    flows straight into the parameter's .grad, which is counted with the gradients."""
    grad_fn = tensor.grad_fn
    while grad_fn is not None and type(grad_fn).__name__ in VIEWS:
        grad_fn = grad_fn.next_functions[0][0]
    return (grad_fn is not None and type(grad_fn).__name__ == "ToCopyBackward0"
            and type(grad_fn.next_functions[0][0]).__name__ == "AccumulateGrad")


@dataclass(frozen=True)
class Activations:
    saved: int       # bytes kept for backward at the end of the forward pass, each storage once
    largest: int     # the largest saved activation gradients flow through (their size in backward),
                     # inside checkpointed blocks too
    recompute: int   # with gradient checkpointing: the largest block's activations, rebuilt in backward


class SavedTensorMeter:
    """Sizes of the storages saved for backward while `recording()`, except those in `exclude`."""

    def __init__(self, exclude: set[int] = frozenset()):
        self.exclude = exclude
        self.sizes: dict[int, int] = {}
        self.largest = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in self.exclude:
            self.sizes[key] = size = tensor.untyped_storage().nbytes()
            if tensor.requires_grad and not is_parameter_cast(tensor):
                self.largest = max(self.largest, size)
        return tensor

    @contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


@contextmanager
def checkpointed_blocks(models: list[torch.nn.Module], exclude: set[int]):
    """Yields a list that fills with a meter per gradient-checkpointed block (its own activations).

    diffusers and transformers both call `module._gradient_checkpointing_func(block, *args)` for a
    checkpointed block; the wrapper runs the block once without the checkpoint to measure what
    its recomputation will hold, then hands over to the real checkpoint function.
    """
    meters: list[SavedTensorMeter] = []
    wrapped = [m for model in models for m in model.modules()
               if callable(getattr(m, "_gradient_checkpointing_func", None))]
    originals = [m._gradient_checkpointing_func for m in wrapped]

    def measuring(original: Callable) -> Callable:
        def run(function, *args, **kwargs):
            inputs = {storage_key(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            meter = SavedTensorMeter(exclude | inputs)  # the inputs are kept by the checkpoint already
            with torch.enable_grad(), meter.recording():
                function(*args, **kwargs)
            meters.append(meter)
            return original(function, *args, **kwargs)
        return run

    for module, original in zip(wrapped, originals):
        module._gradient_checkpointing_func = measuring(original)
    try:
        yield meters
    finally:
        for module, original in zip(wrapped, originals):
            module._gradient_checkpointing_func = original


def measure(models: list[torch.nn.Module], forward: Callable[[], torch.Tensor]) -> Activations:
    """Run `forward` (the family's training forward, returning the loss) and meter what it saves."""
    exclude = {storage_key(t) for model in models for t in (*model.parameters(), *model.buffers())}
    meter = SavedTensorMeter(exclude)
    with checkpointed_blocks(models, exclude) as blocks, meter.recording():
        loss = forward()
    del loss  # kept alive until here: the graph holds the saved tensors the meter counted
    return Activations(saved=meter.total, largest=max([meter.largest, *(block.largest for block in blocks)]),
                       recompute=max((block.total for block in blocks), default=0))
