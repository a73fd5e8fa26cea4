"""Bytes of a model's parameters as the trainer holds them: each in its dtype, and the frozen
denoiser's layers quantized when spec.model.quantization says so."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kubetune_api.memory_rules import QUANTIZED_LINEAR_BYTES

FP8_ROW_SCALE_BYTES = 4  # torchao's float8 weight keeps one fp32 scale per output row


@dataclass(frozen=True)
class ParameterBytes:
    total: int              # parameters
    trained: int            # of which trained (requires_grad)
    bytes: int              # as held in memory
    trained_bytes: int      # of which trained
    largest_trained: int    # bytes of the largest trained tensor (per-tensor optimizer temporaries)


def _is_lora(name: str) -> bool:
    return ".lora_" in f".{name}"


def _quantized_layers(model: torch.nn.Module, quantization: str) -> dict[int, float]:
    """id(weight) -> bytes per element, for the frozen layers the quantizer stores in low precision.

    nf4 (bitsandbytes through diffusers) replaces every nn.Linear's weight; fp8 (kubetune_trainer.training.fp8)
    the weights of the Linear layers whose names it does not keep precise, plus a scale per row.
    Biases stay in the compute dtype. LoRA's own layers are added after quantization and stay fp32;
    the layers it wraps are named here as `<layer>.base_layer`, as they were named when quantized.
    """
    from kubetune_trainer.training.fp8 import KEEP_PRECISE

    keep = KEEP_PRECISE + tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or ())
    per_element = QUANTIZED_LINEAR_BYTES[quantization]
    result: dict[int, float] = {}
    for name, module in model.named_modules():
        name = name.removesuffix(".base_layer")
        if _is_lora(name) or type(module) is not torch.nn.Linear:
            continue
        if quantization == "nf4":
            result[id(module.weight)] = per_element
        elif not any(re.search(pattern, name) for pattern in keep):
            result[id(module.weight)] = per_element + FP8_ROW_SCALE_BYTES / module.in_features
    return result


def parameter_bytes(model: torch.nn.Module, quantization: str | None = None) -> ParameterBytes:
    quantized = _quantized_layers(model, quantization) if quantization else {}
    total = trained = held = trained_held = largest = 0
    for param in model.parameters():  # shared (tied) parameters are listed once
        size = param.numel()
        total += size
        if param.requires_grad:
            trained += size
            trained_held += size * param.element_size()
            largest = max(largest, size * param.element_size())
            held += size * param.element_size()
        else:
            held += int(size * quantized.get(id(param), param.element_size()))
    return ParameterBytes(total, trained, held, trained_held, largest)
