"""Run a meta-device model as if it were on a GPU (or the CPU), without memory or a GPU.

A meta tensor has a shape and a dtype but no data, and its device is "meta", so torch's
device-specific behaviour does not happen: autocast only acts on CUDA (or CPU) tensors, and
attention picks its kernel by device. Fake tensors (torch's FakeTensorMode: meta storage that
reports another device) keep the dispatch of the device they claim, so a forward pass over them
saves for backward exactly the tensors, dtypes and shapes a real training step would.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Inputs are made inside the mode; a real tensor reaching an op means we missed one: fail loudly.
    return FakeTensorMode(allow_non_fake_inputs=False)


def move_to_fake(module: torch.nn.Module, mode, device: str) -> None:
    """Replace the module's parameters, buffers and plain tensor attributes (e.g. rotary tables)
    by fake tensors on `device`, keeping dtypes, shapes, requires_grad and weight tying."""
    converted: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in converted:
            with mode:
                new = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            if isinstance(tensor, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
            converted[id(tensor)] = new
        return converted[id(tensor)]

    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    store[name] = fake(tensor)
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and not name.startswith("_"):
                setattr(sub, name, fake(value))


@contextmanager
def autocast_on(device_type: str, dtype: torch.dtype | None):
    """Autocast as Accelerate applies it, for fake tensors too.

    torch.autocast("cuda") disables itself when no GPU is present; the switches it sets are
    public, so set them directly (dtype None: no autocast, as for mixedPrecision "no").
    """
    if dtype is None:
        yield
        return
    enabled, previous = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, previous)
