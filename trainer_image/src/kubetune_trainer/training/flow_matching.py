"""Rectified-flow (flow-matching) training math for FLUX, Qwen-Image and SD3, as small pure functions.

x_sigma = (1 - sigma) * x0 + sigma * noise; the network predicts the velocity noise - x0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.training.randomness import SampleRandom


def sample_sigmas(random: SampleRandom) -> torch.Tensor:
    """Logit-normal noise levels (SD3's default): more weight on the middle of the path than the ends."""
    return torch.sigmoid(random.normal(()))


def shifted(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """A static time shift, as FlowMatchEulerDiscreteScheduler(shift=...) applies to its schedule:
    shift > 1 moves noise levels towards pure noise (SD3's 3.0 for its 1024 px models)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def noisy_latents(latents: torch.Tensor, random: SampleRandom, shift: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noise, sigmas, x_sigma) for clean latents of shape [B, ...]; each sample's from its own draws,
    the noise levels shifted by `shift` (1: none)."""
    noise = random.normal(latents.shape[1:], latents.device, latents.dtype)
    sigmas = to_device(shifted(sample_sigmas(random), shift), latents.device)
    expanded = sigmas.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return noise, sigmas, (1 - expanded) * latents + expanded * noise


def loss(prediction: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(prediction.float(), velocity.float())
