"""A quantized frozen base (FP8, NF4) where the GPU supports it; a clear refusal everywhere else.

nf4 quantizes while loading (diffusers' BitsAndBytesConfig, bitsandbytes kernels); fp8 after
loading (kubetune_trainer.training.fp8, torchao's float8 weights). Whether this process can do either is
decided by `refusal`, a pure function of what the process has; `cuda_capability` is the one
question asked of CUDA. A CPU job (spec.resources.gpusPerNode 0) never gets this far: the manifest
check refuses quantization there. This is the second line, for a job that asked for GPUs but whose
process has none, or one too old.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from kubetune_trainer.errors import ConfigError

OPTION = "spec.model.quantization"
# Float8 is native from Ada (8.9) and Hopper (9.0) on, and fp8 is promised (and checked on a GPU) for
# those. The weight-only path in kubetune_trainer.training.fp8 only casts, so older GPUs could run it too.
FP8_MIN_CAPABILITY = (8, 9)


def refusal(kind: Optional[str], capability: Optional[tuple[int, int]], importable: frozenset[str]) -> Optional[str]:
    """Why a process cannot run quantization `kind`, or None when it can.

    capability: the CUDA compute capability of the process's GPU, None without one.
    importable: which of the needed packages (bitsandbytes, torchao) are installed.
    """
    if kind is None:
        return None
    if kind == "nf4":
        if capability is None:
            return f"{OPTION}: nf4 needs a CUDA GPU with bitsandbytes; this process has no GPU"
        if "bitsandbytes" not in importable:
            return f"{OPTION}: nf4 needs bitsandbytes: pip install bitsandbytes"
        return None
    if kind == "fp8":
        if capability is None:
            return (f"{OPTION}: fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper); "
                    "this process has no GPU")
        if capability < FP8_MIN_CAPABILITY:
            return (f"{OPTION}: fp8 needs compute capability 8.9+ (Ada, Hopper); this GPU has "
                    f"{capability[0]}.{capability[1]}: use nf4 or no quantization")
        if "torchao" not in importable:
            return f"{OPTION}: fp8 needs torchao: pip install torchao"
        return None
    return f"{OPTION}: unsupported {kind!r}"


def cuda_capability() -> Optional[tuple[int, int]]:
    """The compute capability of this process's CUDA GPU, or None when it has none."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def installed(*packages: str) -> frozenset[str]:
    """Which of `packages` can be imported (found, not imported: bitsandbytes is slow and chatty to import)."""
    return frozenset(name for name in packages if importlib.util.find_spec(name) is not None)


def check_supported(kind: Optional[str]) -> None:
    """Raise ConfigError naming the option unless this process can run `kind`."""
    if kind is None:
        return
    reason = refusal(kind, cuda_capability(), installed("bitsandbytes", "torchao"))
    if reason:
        raise ConfigError(reason)


def load_kwargs(kind: Optional[str], compute_dtype: torch.dtype) -> dict:
    """Extra from_pretrained arguments for the frozen denoiser (nf4 quantizes while loading)."""
    if kind != "nf4":
        return {}
    from diffusers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
    )}


def apply_after_load(kind: Optional[str], model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """fp8: store the frozen Linear weights in float8 (before the LoRA is attached; see kubetune_trainer.training.fp8).

    They dequantize to the dtype they were loaded in, which the families choose as compute_dtype.
    """
    if kind == "fp8":
        from kubetune_trainer.training import fp8

        fp8.quantize_frozen_linears(model)
