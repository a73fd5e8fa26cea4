"""Each family's training forward, on inputs of the shapes and dtypes its compute_loss feeds.

These mirror the denoiser call (and the loss) of kubetune_trainer/families/<family>.py: the
latents the VAE would give at spec.resolution, the conditioning the frozen encoders would
give, the trained module called under autocast as Accelerate wraps it. Encoders are not run:
they work under no_grad before the denoiser, and what they give is only a shape here. Keep a
recipe in step with its family when the family's call changes.

A recipe takes `make(shape, dtype)`, which creates an input tensor (fake on the estimated device,
or real for the benchmark), and `autocast()`, the context the trained module's forward runs in.
"""
from __future__ import annotations

import math
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from kubetune_api.spec import TrainingJobSpec

Make = Callable[[tuple, torch.dtype], torch.Tensor]
Autocast = Callable[[], ContextManager]

CLIP_TOKENS = 77            # CLIP tokenizers pad every caption to 77 tokens
FLUX_T5_TOKENS = 512        # flux_kontext.MAX_TEXT_TOKENS: T5 tokens of the instruction
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


def _mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(prediction.float(), target.float())


def sd15(models, spec: TrainingJobSpec, make: Make, autocast: Autocast, dtype: torch.dtype) -> torch.Tensor:
    unet, side = models["unet"], spec.resolution // vae_scale(models["vae"])
    batch = spec.training.batch_size
    noisy = make((batch, unet.config.in_channels, side, side), dtype)
    text = make((batch, CLIP_TOKENS, unet.config.cross_attention_dim), dtype)
    with autocast():
        prediction = unet(noisy, make((batch,), torch.long), encoder_hidden_states=text).sample
    return _mse(prediction, noisy)


def sdxl(models, spec: TrainingJobSpec, make: Make, autocast: Autocast, dtype: torch.dtype) -> torch.Tensor:
    unet, side = models["unet"], spec.resolution // vae_scale(models["vae"])
    batch = spec.training.batch_size
    noisy = make((batch, unet.config.in_channels, side, side), dtype)
    text = make((batch, CLIP_TOKENS, unet.config.cross_attention_dim), dtype)
    pooled = make((batch, models["text_encoder_2"].config.projection_dim), dtype)
    with autocast():
        prediction = unet(noisy, make((batch,), torch.long), encoder_hidden_states=text,
                          added_cond_kwargs={"text_embeds": pooled, "time_ids": make((batch, 6), dtype)}).sample
    return _mse(prediction, noisy)


def flux_kontext(models, spec: TrainingJobSpec, make: Make, autocast: Autocast, dtype: torch.dtype) -> torch.Tensor:
    transformer, vae = models["transformer"], models["vae"]
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae)
    tokens = (side // 2) ** 2                                   # 2x2 latent patches per token
    width = vae.config.latent_channels * 4
    image = make((batch, 2 * tokens, width), dtype)             # noisy target tokens, then the control's
    text_tokens = FLUX_T5_TOKENS
    with autocast():
        prediction = transformer(
            hidden_states=image, timestep=make((batch,), dtype),
            guidance=make((batch,), torch.float32) if transformer.config.guidance_embeds else None,
            pooled_projections=make((batch, transformer.config.pooled_projection_dim), dtype),
            encoder_hidden_states=make((batch, text_tokens, transformer.config.joint_attention_dim), dtype),
            txt_ids=make((text_tokens, 3), dtype), img_ids=make((2 * tokens, 3), dtype), return_dict=False,
        )[0][:, :tokens]
    return _mse(prediction, make((batch, tokens, width), dtype))


def qwen_image_edit(models, spec: TrainingJobSpec, make: Make, autocast: Autocast, dtype: torch.dtype) -> torch.Tensor:
    transformer, vae = models["transformer"], models["vae"]
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae)
    tokens, width = (side // 2) ** 2, vae.config.z_dim * 4
    text_tokens = qwen_text_tokens(spec.resolution)
    with autocast():
        prediction = transformer(
            hidden_states=make((batch, 2 * tokens, width), dtype), timestep=make((batch,), dtype),
            guidance=make((batch,), torch.float32) if transformer.config.guidance_embeds else None,
            encoder_hidden_states=make((batch, text_tokens, transformer.config.joint_attention_dim), dtype),
            encoder_hidden_states_mask=make((batch, text_tokens), torch.long),
            img_shapes=[[(1, side // 2, side // 2), (1, side // 2, side // 2)]] * batch, return_dict=False,
        )[0][:, :tokens]
    return _mse(prediction, make((batch, tokens, width), dtype))


def pmg(models, spec: TrainingJobSpec, make: Make, autocast: Autocast, dtype: torch.dtype) -> torch.Tensor:
    """The adapter runs the LM under autocast (it is the prepared module); the frozen UNet runs as loaded,
    and the gradient flows back through both to the soft prompts."""
    unet, options = models["unet"], spec.pmg_options
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(models["vae"])
    history = options.max_sequence_length  # padded to the longest history: assume a full one
    with autocast():
        personal = models["adapter"](models["language_model"], make((batch, history), torch.long),
                                     make((batch, history), torch.long))
    text = make((batch, CLIP_TOKENS, unet.config.cross_attention_dim), dtype)
    noisy = make((batch, unet.config.in_channels, side, side), dtype)
    prediction = unet(noisy, make((batch,), torch.long),
                      encoder_hidden_states=torch.cat([text, personal.to(dtype)], 1)).sample
    return _mse(prediction, noisy)


def classifier(models, spec: TrainingJobSpec, make: Make, autocast: Autocast, dtype: torch.dtype) -> torch.Tensor:
    model = models["model"]
    batch, side = spec.training.batch_size, spec.resolution or model.config.image_size
    with autocast():
        logits = model(pixel_values=make((batch, 3, side, side), torch.float32)).logits
    return F.cross_entropy(logits.float(), make((batch,), torch.long))


RECIPES = {"sd15": sd15, "sdxl": sdxl, "flux-kontext": flux_kontext, "qwen-image-edit": qwen_image_edit,
           "pmg": pmg, "classifier": classifier}
