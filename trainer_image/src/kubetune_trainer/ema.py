"""An exponential moving average of the trained weights, updated after every optimizer step."""
from __future__ import annotations

import torch


class EMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params = params
        self.decay = decay
        self.shadow = [p.detach().clone().float() for p in params]

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

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for shadow, saved in zip(self.shadow, state["shadow"], strict=True):
            shadow.copy_(saved)
