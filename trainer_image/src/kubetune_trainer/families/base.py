"""The interface between the generic training loop and a model family."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.cache import EmbeddingCache, Encoded, Encoder
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import split_held_out
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.randomness import SampleRandom


class ModelFamily(ABC):
    """Loads a family's models and data; encodes a batch; computes its loss; saves its weights in
    its own format; samples or scores for validation.

    The loop owns everything else: accumulation, clipping, precision, logging, checkpoints.
    """

    def __init__(self, spec: TrainingJobSpec, device: torch.device, weight_dtype: torch.dtype):
        self.spec = spec
        self.device = device
        self.weight_dtype = weight_dtype
        self.cache: EmbeddingCache | None = None  # set by the run when spec.data.cache is enabled
        self.screen = Screen(spec.data.skip_bad)  # the readers report bad samples to it

    # --- data ---------------------------------------------------------------------------------

    @abstractmethod
    def read_samples(self) -> list:
        """Every sample of the layout under spec.data.uri (paths and texts, nothing decoded); a bad
        record goes to self.screen.reject, which refuses the job or skips it (spec.data.skipBad)."""

    @abstractmethod
    def make_dataset(self, samples: list, training: bool) -> torch.utils.data.Dataset:
        """A data set over `samples` whose items are looked up by (epoch, index) keys.

        training=False: the held-out set, without random augmentations or dropouts.
        """

    def sample_name(self, sample: Any) -> str:
        """What the held-out split hashes: the sample's file name by default."""
        return str(getattr(sample, "path", None) or getattr(sample, "target", None) or getattr(sample, "image"))

    def build_datasets(self, samples: list | None = None
                       ) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
        """(training, held out or None) from `samples` (default: read_samples()), split by
        spec.validation.heldOutFraction."""
        samples = self.read_samples() if samples is None else samples
        training, held_out = split_held_out(samples, self.spec.validation.held_out_fraction, self.sample_name)
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

    def encode(self, name: str, inputs: list[Any], variants: list[list[Any]] | None = None) -> Encoded:
        """Run one frozen encoder on per-sample inputs, through the cache when there is one (which
        also stores each new input's `variants[i]`, the other forms augmentation may draw)."""
        encoder = self.encoders()[name]
        encoded = self.cache.encode(encoder, inputs, variants) if self.cache is not None else encoder.encode(inputs)
        return {key: value.to(self.device) for key, value in encoded.items()}

    def image_transform(self, training: bool, resolution: int | None = None) -> ImageTransform:
        """Resize, crop and flip as spec.data says (held-out data: centre crop, no flip). With the
        embedding cache on, a random crop is chosen once per image, so its latents are reusable."""
        data = self.spec.data
        random_crop = training and not data.center_crop
        return ImageTransform(resolution or self.spec.resolution, not random_crop, data.random_flip and training,
                              crop_per_sample=random_crop and data.cache.enabled)

    def mirror_variants(self, images: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per image, its other flip when flips are random (what the cache stores beside it)."""
        return [[image.flip(-1)] if self.spec.data.random_flip else [] for image in images]

    def caption_variants(self, drawn: list[str], full: list[str]) -> list[list[str]]:
        """Per sample, the caption dropout did not draw: the full one, or the empty one."""
        if not self.spec.data.caption_dropout:
            return [[] for _ in drawn]
        return [[whole] if caption == "" and whole else [""] if caption else [] for caption, whole in zip(drawn, full)]

    def encode_batch(self, batch: dict) -> dict[str, Encoded]:
        """Every cacheable encoding of a batch (what `kubetune train --cache-only` precomputes)."""
        return {}

    @abstractmethod
    def compute_loss(self, model: torch.nn.Module, batch: dict, random: SampleRandom) -> torch.Tensor:
        """The mean training loss over the batch's samples; `model` is the prepared trainable module.

        Every random draw (noise, timesteps, latent samples) comes from `random`, one generator
        per sample, so the loss of a sample does not depend on the rest of its batch."""

    @abstractmethod
    def save_weights(self, out_dir: Path, trained: dict[str, torch.Tensor]) -> list[Path]:
        """Write the trained weights in the family's standard format; return the files written.

        `trained`: every trained parameter whole, on the CPU, by its name in trainable_module
        (checkpointing.full_trained_state gathers them, from shards under FSDP)."""

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
    def evaluate(self, model: torch.nn.Module, batches: list[tuple[dict, SampleRandom]]) -> dict[str, float]:
        """Held-out metrics; by default the loss over every held-out sample, each with the same
        draws at every validation (so two checkpoints compare fairly)."""
        total = sum(self.compute_loss(model, batch, random).item() * len(random) for batch, random in batches)
        return {"loss": total / sum(len(random) for _, random in batches)}

    def sample_images(self, model: torch.nn.Module, held_out: list[dict], generator: torch.Generator) -> list:
        """PIL images for TensorBoard and the checkpoint folder; none by default."""
        return []

    def image_metrics(self, images: list, held_out: list[dict], clip) -> dict[str, float]:
        """What `clip` (evaluation.ClipScorer) says of the images sample_images drew from `held_out`
        (kubetune_api.families lists each family's); none by default."""
        return {}

    # --- trainable state ----------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.trainable_module.parameters() if p.requires_grad]


def whole_state(module: torch.nn.Module, trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full fine-tune's state dict: the trained parameters plus the module's buffers."""
    from torch.distributed.tensor import DTensor

    state = {name: value for name, value in module.state_dict().items() if not isinstance(value, DTensor)}
    state.update(trained)
    missing = sorted(set(module.state_dict()) - set(state))
    if missing:
        raise RuntimeError(f"cannot save {type(module).__name__} whole: {missing[:3]} are neither trained nor local")
    return {name: value.detach().cpu().contiguous() for name, value in state.items()}


def save_diffusers_model(module: torch.nn.Module, trained: dict[str, torch.Tensor], folder: Path) -> list[Path]:
    """A fully fine-tuned diffusers model in its from_pretrained layout (config + safetensors)."""
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    module.save_config(folder)
    save_file(whole_state(module, trained), folder / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
    return sorted(folder.iterdir())
