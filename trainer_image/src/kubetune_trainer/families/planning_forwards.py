"""What the families' planning forwards share (each family's own is its DEFINITION.forward).

A planning forward runs a family's training forward on inputs of the shapes and dtypes its
compute_loss feeds: the latents the VAE would give at spec.resolution (a [width, height] size counts
as the square of its area: activations grow with pixels), the conditioning the frozen encoders would
give, the trained module called under autocast as Accelerate wraps it. Encoders are not run: they
work under no_grad before the denoiser, and what they give is only a shape here. It lives beside
compute_loss in the family's module: keep the two in step.

A forward takes `make(shape, dtype)`, which creates an input tensor (fake on the estimated device,
or real for the benchmark), and `autocast()`, the context the trained module's forward runs in.
"""
from __future__ import annotations

import math
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

Make = Callable[[tuple, torch.dtype], torch.Tensor]
Autocast = Callable[[], ContextManager]

CLIP_TOKENS = 77            # CLIP tokenizers pad every caption to 77 tokens
QWEN_PROMPT_TOKENS = 64     # the instruction's text tokens assumed for Qwen-Image-Edit (plus the image's)
QWEN_TEMPLATE_TOKENS = 10   # chat-template tokens left after the pipeline drops the system prompt


def vae_scale(vae) -> int:
    """How many pixels one latent covers per side."""
    config = vae.config
    if hasattr(config, "temperal_downsample"):  # Qwen-Image's video-shaped VAE: 2x per downsampling stage
        return 2 ** len(config.temperal_downsample)
    return 2 ** (len(config.block_out_channels) - 1)


def qwen_image_tokens(resolution: int, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280) -> int:
    """Vision tokens Qwen2.5-VL makes of a square control image: the processor resizes it to a
    multiple of 28 within [min_pixels, max_pixels], cuts 14 px patches and merges 2x2 of them."""
    side = max(28, round(resolution / 28) * 28)
    if side * side > max_pixels:
        side = math.floor(resolution / math.sqrt(resolution * resolution / max_pixels) / 28) * 28
    elif side * side < min_pixels:
        side = math.ceil(resolution * math.sqrt(min_pixels / (resolution * resolution)) / 28) * 28
    return (side // 28) ** 2


def qwen_text_tokens(resolution: int) -> int:
    """The Qwen-Image-Edit prompt embedding's length: the control image's vision tokens, the instruction, the template."""
    return qwen_image_tokens(resolution) + QWEN_PROMPT_TOKENS + QWEN_TEMPLATE_TOKENS


def mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(prediction.float(), target.float())
