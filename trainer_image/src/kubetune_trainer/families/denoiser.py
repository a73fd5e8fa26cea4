"""A diffusers denoiser (a UNet or DiT) as every diffusion family loads and trains it: one part, composed."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kubetune_trainer.training import quantization
from kubetune_trainer.families.trainable import Trainable, diffusers_denoiser


def load_denoiser(spec, cls, subfolder: str, weight_dtype: torch.dtype) -> torch.nn.Module:
    """`<spec.model.pretrained>/<subfolder>` as CLS, quantized when spec.model.quantization says so.

    Frozen weights load in the training precision; a fully trained model stays in fp32 (autocast
    computes in the training precision). Neither made trainable nor moved to the device."""
    quant = spec.model.quantization
    frozen_dtype = weight_dtype if spec.adapter.type == "lora" else torch.float32
    model = cls.from_pretrained(spec.model.pretrained, subfolder=subfolder, torch_dtype=frozen_dtype,
                                **quantization.load_kwargs(quant, weight_dtype))
    quantization.apply_after_load(quant, model, weight_dtype)
    return model


def train_denoiser(model: torch.nn.Module, spec, prefix: str, pipeline: str, device: torch.device,
                   exclude: Sequence[str] = (), targets: list[str] | None = None) -> Trainable:
    """Make the denoiser trainable (all of it, or a possibly pre-initialised LoRA on `targets`, default the
    usual attention projections, without the modules in `exclude`: families.trainable) and put it on the
    device in training mode."""
    trainable = diffusers_denoiser(model, spec.adapter, prefix, pipeline, exclude=exclude, targets=targets)
    model.to(device).train()
    return trainable
