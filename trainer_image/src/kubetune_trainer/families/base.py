"""The interface between the generic training loop and a model family."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.cache import EmbeddingCache, Encoded, Encoder
from kubetune_trainer.data.keyed import split_held_out
from kubetune_trainer.errors import ConfigError


class ModelFamily(ABC):
    """Loads a family's models and data; encodes a batch; computes its loss; saves its weights in
    its own format; samples or scores for validation.

    The loop owns everything else: accumulation, clipping, precision, logging, checkpoints.
    """

    def __init__(self, spec: TrainingJobSpec, device: torch.device, weight_dtype: torch.dtype):
        self.spec = spec
        self.device = device
        self.weight_dtype = weight_dtype
        self.cache: EmbeddingCache | None = None  # set by main when spec.data.cache is enabled

    # --- data ---------------------------------------------------------------------------------

    @abstractmethod
    def read_samples(self) -> list:
        """Every sample of the layout under spec.data.uri (paths and texts, nothing decoded)."""

    @abstractmethod
    def make_dataset(self, samples: list, training: bool) -> torch.utils.data.Dataset:
        """A data set over `samples` whose items are looked up by (epoch, index) keys.

        training=False: the held-out set, without random augmentations or dropouts.
        """

    def sample_name(self, sample: Any) -> str:
        """What the held-out split hashes: the sample's file name by default."""
        return str(getattr(sample, "path", None) or getattr(sample, "target", None) or getattr(sample, "image"))

    def build_datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
        """(training, held out or None), split by spec.validation.heldOutFraction."""
        training, held_out = split_held_out(self.read_samples(), self.spec.validation.held_out_fraction,
                                            self.sample_name)
        return self.make_dataset(training, True), (self.make_dataset(held_out, False) if held_out else None)

    @abstractmethod
    def collate(self, items: list[dict]) -> dict:
        """Stack items into a batch."""

    # --- model --------------------------------------------------------------------------------

    @property
    @abstractmethod
    def trainable_module(self) -> torch.nn.Module:
        """The module whose gradients are synchronised across processes (wrapped by Accelerate)."""

    def encoders(self) -> dict[str, Encoder]:
        """The frozen encoders whose per-sample outputs the embedding cache may keep."""
        return {}

    def encode(self, name: str, inputs: list[Any]) -> Encoded:
        """Run one frozen encoder on per-sample inputs, through the cache when there is one."""
        encoder = self.encoders()[name]
        encoded = self.cache.encode(encoder, inputs) if self.cache is not None else encoder.encode(inputs)
        return {key: value.to(self.device) for key, value in encoded.items()}

    def encode_batch(self, batch: dict) -> dict[str, Encoded]:
        """Every cacheable encoding of a batch (what `kubetune train --cache-only` precomputes)."""
        return {}

    @abstractmethod
    def compute_loss(self, model: torch.nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """The training loss of one batch; `model` is the prepared trainable module."""

    @abstractmethod
    def save_weights(self, out_dir: Path) -> list[Path]:
        """Write the trained weights in the family's standard format; return the files written."""

    def enable_gradient_checkpointing(self) -> None:
        module = self.trainable_module
        if hasattr(module, "enable_gradient_checkpointing"):  # diffusers
            module.enable_gradient_checkpointing()
        elif hasattr(module, "gradient_checkpointing_enable"):  # transformers
            module.gradient_checkpointing_enable()
        else:
            raise ConfigError(f"spec.training.gradientCheckpointing: {type(module).__name__} does not support it")

    # --- validation ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batches: list[dict], generator: torch.Generator) -> dict[str, float]:
        """Held-out metrics; by default the loss, averaged over the batches, with a fixed generator."""
        losses = [self.compute_loss(model, batch, generator).item() for batch in batches]
        return {"loss": sum(losses) / len(losses)}

    def sample_images(self, model: torch.nn.Module, held_out: list[dict], generator: torch.Generator) -> list:
        """PIL images for TensorBoard and the checkpoint folder; none by default."""
        return []

    # --- trainable state ----------------------------------------------------------------------

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
