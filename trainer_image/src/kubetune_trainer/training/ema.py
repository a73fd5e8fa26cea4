"""An exponential moving average of the trained weights, updated after every optimizer step.

The average lives beside each parameter in the same layout (a shard of it under FSDP), so
updating and swapping are local, and checkpoints save it by parameter name with the rest of the
sharded state.
"""
from __future__ import annotations

import torch


class EMA:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], decay: float):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.decay = decay
        self.shadow = [p.detach().clone().float() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        for shadow, param in zip(self.shadow, self.params):
            shadow.lerp_(param.detach().float(), 1.0 - self.decay)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Update after each real optimizer step (a step skipped by the fp16 scaler does not count)."""
        inner = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
        inner.register_step_post_hook(lambda *_: self.update())

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange trained and averaged weights: call before saving the average, again after."""
        for shadow, param in zip(self.shadow, self.params):
            current = param.detach().clone()
            param.copy_(shadow.to(param.dtype))
            shadow.copy_(current.float())

    def named_shadow(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow, strict=True))

    @torch.no_grad()
    def load_named_shadow(self, saved: dict[str, torch.Tensor]) -> None:
        for name, shadow in zip(self.names, self.shadow):
            shadow.copy_(saved[name])
