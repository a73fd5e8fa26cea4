"""The attention kernel a GPU run uses (spec.training.attention), chosen once and stated in the log.

Every family's models call PyTorch's scaled_dot_product_attention (diffusers' native backend,
transformers' sdpa), so the choice is made where SDPA dispatches, for all of them at once:

- FlashAttention 3 on a Hopper GPU (compute capability 9.0) when the image has its kernels (the
  `flash_attn_interface` module built from flash-attention's hopper/ folder: PyPI has no wheel of
  it, only an empty placeholder) and this torch can route SDPA's flash path to them;
- else SDPA's flash and memory-efficient kernels.

cuDNN's attention stays off on every GPU run. Measured on an H200 (torch 2.11+cu130, 2026-11-26,
benchmarks/gpu_lora_step.py): its backward hit an illegal memory access on FLUX.1 Kontext at 1024 px
(8,704 tokens), with and without gradient checkpointing; without cuDNN the same run trained. The
planner's memory estimate assumes the flash / memory-efficient kernels too.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

from kubetune_trainer.errors import ConfigError

FA3_MODULE = "flash_attn_interface"


def choose_attention(requested: str, device: torch.device) -> str:
    """Set up the kernel spec.training.attention asks for on `device`; returns what the log says."""
    if device.type != "cuda":
        return "PyTorch SDPA on the CPU"
    torch.backends.cuda.enable_cudnn_sdp(False)
    name = torch.cuda.get_device_name(device)
    missing = fa3_missing(device)
    if requested == "flash3" and missing:
        raise ConfigError(f"spec.training.attention: flash3 cannot run here: {missing}; use auto or sdpa")
    if requested != "sdpa" and not missing:
        torch.nn.attention.activate_flash_attention_impl("FA3")
        return f"FlashAttention 3 through PyTorch SDPA on {name} (cuDNN attention off)"
    reason = "as asked" if requested == "sdpa" else f"FlashAttention 3 unavailable: {missing}"
    return f"PyTorch SDPA flash / memory-efficient kernels on {name} ({reason}; cuDNN attention off)"


def fa3_missing(device: torch.device) -> str | None:
    """Why FlashAttention 3 cannot run on `device` (None when it can)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"it needs a Hopper GPU (compute capability 9.0), this one is {major}.{minor}"
    attention = torch.nn.attention
    if "FA3" not in getattr(attention, "list_flash_attention_impls", lambda: [])():
        return f"torch {torch.__version__} has no FlashAttention 3 route for SDPA"
    if importlib.util.find_spec(FA3_MODULE) is None:
        return (f"its kernels are not in this image (module {FA3_MODULE}, built from flash-attention's hopper/ "
                "folder; PyPI has no wheel of it)")
    importlib.import_module(FA3_MODULE)
    if not hasattr(torch.ops.flash_attn_3, "fwd"):  # torch.ops makes up any namespace asked for; ops it does not
        return f"module {FA3_MODULE} is installed but registers no flash_attn_3 kernels (the PyPI placeholder?)"
    return None
