"""A quantized frozen base (FP8, NF4) where the GPU supports it; a clear refusal everywhere else."""
from __future__ import annotations

import torch

from kubetune_trainer.errors import ConfigError

OPTION = "spec.model.quantization"


def check_supported(kind: str | None) -> None:
    """Raise ConfigError naming the option unless this process can run `kind`."""
    if kind is None:
        return
    if kind == "nf4":
        if not torch.cuda.is_available():
            raise ConfigError(f"{OPTION}: nf4 needs a CUDA GPU with bitsandbytes; this process has no GPU")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ConfigError(f"{OPTION}: nf4 needs bitsandbytes: pip install bitsandbytes") from None
        return
    if kind == "fp8":
        if not torch.cuda.is_available():
            raise ConfigError(f"{OPTION}: fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper); "
                              "this process has no GPU")
        if torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            raise ConfigError(f"{OPTION}: fp8 needs compute capability 8.9+; this GPU has {major}.{minor}")
        return
    raise ConfigError(f"{OPTION}: unsupported {kind!r}")


def load_kwargs(kind: str | None, compute_dtype: torch.dtype) -> dict:
    """Extra from_pretrained arguments for the frozen denoiser (nf4 quantizes while loading)."""
    if kind != "nf4":
        return {}
    from diffusers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
    )}


def apply_after_load(kind: str | None, model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """fp8: store frozen weights in float8 and upcast each layer as it runs (diffusers layerwise casting)."""
    if kind == "fp8":
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype)
