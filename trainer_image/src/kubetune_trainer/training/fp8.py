"""spec.model.quantization fp8: the frozen denoiser's Linear weights stored in float8 (e4m3, one scale
per output row, by torchao) under a LoRA that trains in full precision.

Why not torchao's own float8 linear for training: autograd keeps a matmul's operands for the
backward pass, and torchao's weight-only linear multiplies by a dequantized copy, so every layer's
high-precision weight would stay alive until backward: the memory fp8 was meant to save, and more.
Here each quantized layer runs through `_Float8Linear`, which keeps only the float8 weight (it is
the layer's own parameter, not a copy) and dequantizes it again in backward. The forward and the
backward use the same dequantized weight, so the LoRA's gradients are exact for the quantized base.

The matmul runs in the training precision (weight-only quantization: memory, not speed), so it
needs only float8 casts; the trainer asks for compute capability 8.9+ (kubetune_trainer.training.quantization).
"""
from __future__ import annotations

import re
import warnings

import torch
import torch.nn.functional as F

# Layers left in the training precision, by qualified-name pattern: adaptive-norm modulations (they
# scale every token), embedders and the projections in and out of latent space. They hold a small
# share of the weights; a model's own `_skip_layerwise_casting_patterns` (diffusers) are added.
KEEP_PRECISE = ("norm", "embed", r"^proj_in$", r"^proj_out$")


class _Float8Linear(torch.autograd.Function):
    """y = x W^T + b with W a frozen torchao Float8Tensor, saving W (float8) instead of a dequantized copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if ctx.needs_input_grad[1]:
            raise RuntimeError("fp8 weights are frozen: train a LoRA on top (spec.adapter.type lora)")
        ctx.weight = weight  # the parameter itself: nothing new stays alive for backward
        ctx.bias_shape = None if bias is None else bias.shape
        return F.linear(x, weight.dequantize(), bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ ctx.weight.dequantize(grad_out.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).reshape(ctx.bias_shape)
        return grad_x, None, grad_bias


class Float8FrozenLinear(torch.nn.Linear):
    """An nn.Linear whose weight is a torchao Float8Tensor; to peft and diffusers it is still a Linear
    (peft wraps it with its torchao LoRA layer, since the weight is a torchao tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Float8Linear.apply(x, self.weight, self.bias)


class _Float8WeightNames:
    """The names of a model's float8 weights, listed when read rather than when made.

    DDP skips the parameters named in a module's `_ddp_params_and_buffers_to_ignore` when it wraps
    it: it cannot broadcast a Float8Tensor, and need not, since every rank loads and quantizes the
    same frozen weights. It reads the names then, after peft has renamed the layers it adapted.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __iter__(self):
        return (name for name, param in self.model.named_parameters() if is_float8(param))


def is_float8(weight: torch.Tensor) -> bool:
    from torchao.quantization import Float8Tensor

    return isinstance(weight, Float8Tensor)


def quantize_frozen_linears(model: torch.nn.Module) -> int:
    """Store the weights of `model`'s Linear layers (but KEEP_PRECISE ones) in float8; returns how many.

    Call it before attaching the LoRA and before moving the model to its GPU (the float8 weights
    move as they are). The weights' reported dtype stays the loading dtype, so peft creates the
    LoRA in that dtype, not in float8. `model` must be the module DDP wraps (the denoiser).
    """
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    keep = KEEP_PRECISE + tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or ())

    def chosen(module: torch.nn.Module, name: str) -> bool:
        return type(module) is torch.nn.Linear and not any(re.search(pattern, name) for pattern in keep)

    # set_inductor_config=False: leave torch.compile's global settings alone.
    quantize_(model, Float8WeightOnlyConfig(set_inductor_config=False), filter_fn=chosen)
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and is_float8(module.weight):
            module.__class__ = Float8FrozenLinear  # same state, our forward
            count += 1
    model._ddp_params_and_buffers_to_ignore = _Float8WeightNames(model)
    # peft's torchao LoRA layer warns that it could not merge into the quantized base: the trainer
    # never merges (the LoRA is saved on its own).
    warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without", category=UserWarning)
    return count
