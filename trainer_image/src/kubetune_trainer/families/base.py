"""The interface between the generic training loop and a model family."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.errors import ConfigError


class ModelFamily(ABC):
    """Loads a family's models and data; computes its loss; saves its weights in its own format.

    The loop owns everything else: accumulation, clipping, precision, logging, checkpoints.
    """

    def __init__(self, spec: TrainingJobSpec, device: torch.device, weight_dtype: torch.dtype):
        self.spec = spec
        self.device = device
        self.weight_dtype = weight_dtype

    @property
    @abstractmethod
    def trainable_module(self) -> torch.nn.Module:
        """The module whose gradients are synchronised across processes (wrapped by Accelerate)."""

    @abstractmethod
    def build_dataset(self) -> torch.utils.data.Dataset:
        """The training data set; items are looked up by (epoch, index) keys."""

    @abstractmethod
    def collate(self, items: list[dict]) -> dict:
        """Stack items into a batch."""

    @abstractmethod
    def compute_loss(self, model: torch.nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """The training loss of one batch; `model` is the prepared trainable module."""

    @abstractmethod
    def save_weights(self, out_dir: Path) -> list[Path]:
        """Write the trained weights in the family's standard format; return the files written."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.trainable_module.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Only what training changes: small for LoRA, the whole model for full fine-tuning."""
        return {
            name: param.detach().to("cpu", copy=True).contiguous()
            for name, param in self.trainable_module.named_parameters()
            if param.requires_grad
        }

    def load_trainable_state_dict(self, state: dict[str, Any]) -> None:
        params = dict(self.trainable_module.named_parameters())
        expected = {name for name, p in params.items() if p.requires_grad}
        mismatched = sorted(n for n in set(state) & expected if state[n].shape != params[n].shape)
        if set(state) != expected or mismatched:
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ConfigError(
                "checkpoint does not match the adapter (spec.adapter rank or targetModules changed?): "
                f"missing {missing[:2]}, unexpected {unexpected[:2]}, other shape {mismatched[:2]}"
            )
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
