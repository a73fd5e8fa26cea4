"""Optimizers and learning-rate schedules.

Schedules are defined in optimizer steps and stepped once per optimizer step by the loop (never
through `accelerator.prepare`), so they do not depend on the number of processes.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from kubetune_api.spec import TrainingSpec


def build_optimizer(params: Iterable[torch.nn.Parameter], spec: TrainingSpec) -> torch.optim.Optimizer:
    params = list(params)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(
            params, lr=spec.learning_rate, betas=(spec.adam_beta1, spec.adam_beta2),
            eps=spec.adam_epsilon, weight_decay=spec.weight_decay,
        )
    raise ValueError(f"spec.training.optimizer: unsupported {spec.optimizer!r}")


def lr_multiplier(step: int, kind: str, warmup_steps: int, total_steps: int) -> float:
    """Fraction of the peak learning rate at an optimizer step (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"spec.training.lrScheduler: unsupported {kind!r}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, spec: TrainingSpec, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, spec.lr_scheduler, spec.lr_warmup_steps, total_steps),
    )
