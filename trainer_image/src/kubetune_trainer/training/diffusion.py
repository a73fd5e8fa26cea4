"""Denoising-loss math shared by the diffusion families, as small pure functions."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kubetune_trainer.training.randomness import SampleRandom


def sample_latents(moments: torch.Tensor, random: SampleRandom) -> torch.Tensor:
    """A draw from the VAE's diagonal Gaussian per sample: mean + std * noise.

    `moments` is the encoder's output, mean and log-variance stacked on dim 1 (what diffusers'
    DiagonalGaussianDistribution takes, with the same clamp of the log-variance).
    """
    mean, logvar = moments.chunk(2, dim=1)
    std = torch.exp(0.5 * torch.clamp(logvar, -30.0, 20.0))
    return mean + std * random.normal(mean.shape[1:], mean.device, mean.dtype)


def sample_noise(latents: torch.Tensor, random: SampleRandom, noise_offset: float = 0.0) -> torch.Tensor:
    """Gaussian noise like the latents; offset noise adds a per-channel constant (darker/brighter images)."""
    noise = random.normal(latents.shape[1:], latents.device, latents.dtype)
    if noise_offset:
        offset = random.normal((latents.shape[1], 1, 1), latents.device, latents.dtype)
        noise = noise + noise_offset * offset
    return noise


def sample_timesteps(random: SampleRandom, num_train_timesteps: int, device: torch.device) -> torch.Tensor:
    return random.integers(num_train_timesteps, device)


def training_target(scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """What the network must predict, by the scheduler's prediction type."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    if kind == "sample":
        return latents
    raise ValueError(f"unsupported prediction type {kind!r}")


def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) at each timestep."""
    alpha_bar = alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alpha_bar / (1.0 - alpha_bar)


def min_snr_weights(snr_values: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023): min(snr, gamma) / snr, or / (snr + 1) for v."""
    clipped = torch.clamp(snr_values, max=gamma)
    if prediction_type == "v_prediction":
        return clipped / (snr_values + 1.0)
    return clipped / snr_values


def denoising_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error per sample, optionally weighted, averaged over the batch (in fp32)."""
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    if weights is not None:
        per_sample = per_sample * weights
    return per_sample.mean()
