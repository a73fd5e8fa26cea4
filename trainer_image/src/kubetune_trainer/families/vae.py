"""The VAE a diffusion family encodes images with: the model's own (<spec.model.pretrained>/vae) or
the one spec.model.vae names (e.g. SDXL's fp16-fix VAE), one part every family composes.

A replacement must make latents of the shape the denoiser was trained on: its latent channels are
compared with the model's own VAE's before anything loads. In fp16, a VAE whose config asks for it
(`force_upcast`, as SDXL's stock VAE does: its activations overflow fp16 into NaNs) runs in fp32,
as diffusers' pipelines run it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kubetune_trainer.errors import ConfigError

SUBFOLDER = "vae"
CHANNEL_KEYS = ("latent_channels", "z_dim")  # AutoencoderKL's name, then Qwen-Image's video VAE's


def vae_source(spec) -> tuple[str, str | None]:
    """(folder or hub id, subfolder) of the VAE: spec.model.vae (a VAE's own folder, or a model
    folder holding vae/), else the model's own vae/ folder."""
    chosen = spec.model.vae
    if chosen is None:
        return spec.model.pretrained, SUBFOLDER
    return (chosen, SUBFOLDER) if (Path(chosen) / SUBFOLDER / "config.json").is_file() else (chosen, None)


def load_vae(spec, cls, weight_dtype: torch.dtype) -> torch.nn.Module:
    """The family's VAE as CLS (a diffusers autoencoder class), frozen weights in the training
    precision (fp32 where fp16 would overflow); neither moved nor made trainable."""
    path, subfolder = vae_source(spec)
    if spec.model.vae is not None:
        _check_channels(spec, cls, path, subfolder)
    vae = cls.from_pretrained(path, subfolder=subfolder, torch_dtype=weight_dtype)
    if weight_dtype == torch.float16 and getattr(vae.config, "force_upcast", False):
        vae.to(torch.float32)
    return vae


def vae_name(spec) -> str:
    """The VAE's folder or hub id, for the embedding cache's identity of its latents."""
    path, subfolder = vae_source(spec)
    return f"{path}/{subfolder}" if subfolder else path


def _check_channels(spec, cls, path: str, subfolder: str | None) -> None:
    own = cls.load_config(spec.model.pretrained, subfolder=SUBFOLDER)
    chosen = cls.load_config(path, subfolder=subfolder)
    key = next((k for k in CHANNEL_KEYS if k in own), None)
    if key is not None and chosen.get(key) != own[key]:
        raise ConfigError(
            f"spec.model.vae: {spec.model.vae} makes {chosen.get(key)}-channel latents but the {spec.model.family} "
            f"model in spec.model.pretrained was trained on {own[key]} ({key} of its own vae/); use a VAE made for "
            "this model, or remove spec.model.vae")
