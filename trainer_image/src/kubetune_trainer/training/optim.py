"""Optimizers and learning-rate schedules.

Schedules are defined in optimizer steps and stepped once per optimizer step by the loop (never
through `accelerate.prepare`), so they do not depend on the number of processes.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from kubetune_api.spec_training import TrainingSpec
from kubetune_trainer.errors import ConfigError


def _require_cuda_bitsandbytes(option: str):
    if not torch.cuda.is_available():
        raise ConfigError(f"{option} needs a CUDA GPU with bitsandbytes; this process has no GPU")
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(f"{option} needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes


def build_optimizer(params: Iterable[torch.nn.Parameter], spec: TrainingSpec) -> torch.optim.Optimizer:
    params = list(params)
    lr, betas, decay = spec.learning_rate, (spec.adam_beta1, spec.adam_beta2), spec.weight_decay
    kind = spec.optimizer
    if kind == "adamw":
        # On a GPU, one fused kernel updates every tensor (the default launches several per
        # tensor group: hundreds of launches a step for a LoRA's many small matrices). FSDP's
        # sharded (DTensor) parameters keep the default: no multi-GPU run has measured them fused.
        from torch.distributed.tensor import DTensor

        fused = bool(params) and all(p.device.type == "cuda" and not isinstance(p.data, DTensor) for p in params)
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=spec.adam_epsilon, weight_decay=decay,
                                 fused=fused or None)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=spec.sgd_momentum, weight_decay=decay)
    if kind == "adamw8bit":
        bnb = _require_cuda_bitsandbytes("spec.training.optimizer: adamw8bit")
        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=spec.adam_epsilon, weight_decay=decay)
    if kind == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, lr=lr, betas=betas, eps=spec.adam_epsilon, weight_decay=decay)
    if kind == "lion":
        from lion_pytorch import Lion

        return Lion(params, lr=lr, betas=betas, weight_decay=decay)
    if kind == "schedulefree-adamw":
        from schedulefree import AdamWScheduleFree

        # Warmup is part of the method (it must see it to weight its averages), not a LambdaLR.
        return AdamWScheduleFree(params, lr=lr, betas=betas, eps=spec.adam_epsilon, weight_decay=decay,
                                 warmup_steps=spec.lr_warmup_steps)
    raise ConfigError(f"spec.training.optimizer: unsupported {kind!r}")


def set_optimizer_mode(optimizer, training: bool) -> None:
    """Schedule-free optimizers keep two points: train at one, evaluate and save the other."""
    switch = getattr(optimizer, "train" if training else "eval", None)
    if callable(switch):
        switch()


def lr_multiplier(step: int, kind: str, warmup_steps: int, total_steps: int, cycles: int = 1,
                  step_size: int = 1, gamma: float = 1.0) -> float:
    """Fraction of the peak learning rate at an optimizer step (0-based), for the stateless schedules."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind in ("constant", "plateau"):  # plateau decays are applied on top, by PlateauScheduler
        return 1.0
    after_warmup = step - warmup_steps
    if kind == "step":
        return gamma ** (after_warmup // step_size)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, after_warmup / decay_steps)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "cosine-restarts":
        # Each cycle decays from the peak to 0; the last step of the run ends a cycle.
        cycle_progress = (progress * cycles) % 1.0 if progress < 1.0 else 1.0
        return 0.5 * (1.0 + math.cos(math.pi * cycle_progress))
    raise ConfigError(f"spec.training.lrScheduler: unsupported {kind!r}")


class PlateauScheduler(torch.optim.lr_scheduler.LambdaLR):
    """Warmup, then the learning rate times `gamma` whenever `patience` observed losses brought no new best.

    The loop steps it like every schedule; the losses come separately through `observe`, from the
    validation when it runs, else from training.
    """

    def __init__(self, optimizer, warmup_steps: int, gamma: float, patience: int):
        self.gamma, self.patience = gamma, patience
        self.best, self.bad_observations, self.factor = math.inf, 0, 1.0
        super().__init__(optimizer, lambda step: lr_multiplier(step, "plateau", warmup_steps, 0) * self.factor)

    def observe(self, loss: float) -> None:
        if loss < self.best:
            self.best, self.bad_observations = loss, 0
            return
        self.bad_observations += 1
        if self.bad_observations >= self.patience:
            self.factor *= self.gamma
            self.bad_observations = 0

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["plateau"] = {"best": self.best, "bad": self.bad_observations, "factor": self.factor}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        plateau = state_dict.pop("plateau")
        super().load_state_dict(state_dict)
        self.best, self.bad_observations, self.factor = plateau["best"], plateau["bad"], plateau["factor"]


def follow_spec_after_resume(optimizer: torch.optim.Optimizer, scheduler, spec: TrainingSpec) -> None:
    """A checkpoint gives back the optimizer's moments and the schedule's position, but the
    hyperparameters are the spec's: a run resumed with another learning rate, weight decay or betas
    (population-based training's perturbed copies, or a user's own change) trains with them.
    Unchanged values make this a no-op."""
    settings = {"weight_decay": spec.weight_decay, "betas": (spec.adam_beta1, spec.adam_beta2),
                "eps": spec.adam_epsilon, "momentum": spec.sgd_momentum}
    for group in optimizer.param_groups:
        group["initial_lr"] = spec.learning_rate
        for key, value in settings.items():
            if key in group:
                group[key] = value
    scheduler.base_lrs = [spec.learning_rate] * len(optimizer.param_groups)
    # Where the schedule stands now, at the new peak (every schedule here is a LambdaLR).
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def build_lr_scheduler(optimizer: torch.optim.Optimizer, spec: TrainingSpec, total_steps: int):
    if spec.optimizer == "schedulefree-adamw":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if spec.lr_scheduler == "plateau":
        return PlateauScheduler(optimizer, spec.lr_warmup_steps, spec.lr_gamma, spec.lr_plateau_patience)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, spec.lr_scheduler, spec.lr_warmup_steps, total_steps,
                                   spec.lr_cycles, spec.lr_step_size, spec.lr_gamma),
    )
