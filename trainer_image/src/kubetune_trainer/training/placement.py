"""Where the models' weights live on a GPU run, and in which memory layout.

A UNet's convolutions run fastest on a GPU with its 4-D weights in channels_last (NHWC) order:
cuDNN's tensor-core convolution kernels work in that order, and a model kept in the default
(NCHW) order pays a transpose around every convolution. Transformers (DiTs) have no convolutions
in their blocks and are left as they are.
"""
from __future__ import annotations

import torch


def has_convolutions(module: torch.nn.Module) -> bool:
    return any(isinstance(sub, torch.nn.Conv2d) for sub in module.modules())


def use_channels_last(module: torch.nn.Module, device: torch.device) -> bool:
    """Put a convolutional model's 4-D weights in channels_last order on a GPU; whether it did."""
    if device.type != "cuda" or not has_convolutions(module):
        return False
    module.to(memory_format=torch.channels_last)
    return True
