"""The interface between the generic training loop and a model family.

A family's module also declares what the trainer derives from it besides this class (its
reference architecture, planning forward, tiny model...): families.definition says how.
"""
from __future__ import annotations

import logging
from abc import ABCMeta, abstractmethod
from contextlib import contextmanager
from typing import Any
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJobSpec, encoders_on_gpu
from kubetune_trainer.data.cache import EmbeddingCache, Encoded, Encoder
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.layout_parts import Layout
from kubetune_trainer.data.layouts import LAYOUTS
from kubetune_trainer.data.keyed import split_held_out
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.results.drawing import Draw
from kubetune_trainer.families.trainable import Trainable, enable_gradient_checkpointing
from kubetune_trainer.training.randomness import SampleRandom
from kubetune_trainer.storage.members import MEMBERS

log = logging.getLogger("kubetune.trainer")
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reference_path(sample: Any) -> Path:
    """The image (or clip) a sample of any layout trains towards."""
    return Path(getattr(sample, "path", None) or getattr(sample, "target", None) or getattr(sample, "image"))


def sample_name(spec: TrainingJobSpec, sample: Any) -> str:
    """ModelFamily.sample_name for any sample of spec.data.uri."""
    path = reference_path(sample)
    if (member := MEMBERS.member(path)) is not None:
        return member.name  # an image inside a parquet file or a shard: the name it was stored under
    root = Path(spec.data.uri)
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def training_and_held_out(spec: TrainingJobSpec, samples: list, screen: Screen) -> tuple[list, list]:
    """(training, held out) of the samples: the layout's held-out file where it names one, else
    spec.validation.heldOutFraction of them by name (also what `kubetune evaluate` scores, without a model)."""
    held_out = LAYOUTS[spec.data.layout].held_out(spec, screen)
    if held_out is not None:
        return samples, held_out
    return split_held_out(samples, spec.validation.held_out_fraction, lambda sample: sample_name(spec, sample))


class _PlacesFrozenModels(ABCMeta):
    """Calls place_frozen() once a family's __init__ has returned: no family moves its frozen models itself."""

    def __call__(cls, *args, **kwargs):
        family = super().__call__(*args, **kwargs)
        family.place_frozen()
        return family


class ModelFamily(metaclass=_PlacesFrozenModels):
    """Loads a family's models; encodes a batch; computes its loss; samples or scores for validation.

    Shared by every family: data through the layout table (data.layouts), what trains and how it
    is saved through self.trainable (families.trainable), and its frozen models (frozen_models()),
    which the base freezes and places once the family's __init__ has loaded them (place_frozen).
    The loop owns everything else: accumulation, clipping, precision, logging, checkpoints.

    A family's __init__ loads its models, sets self.trainable (and puts the trained module on the
    device, in training mode); it leaves its frozen models where they loaded.
    """

    # Names in frozen_models() that the training step runs even when the embedding cache holds every
    # encoding (PMG's language model, which reads each history through the trained adapter).
    needed_in_step: tuple[str, ...] = ()

    def __init__(self, spec: TrainingJobSpec, device: torch.device, weight_dtype: torch.dtype):
        self.spec = spec
        self.device = device
        self.weight_dtype = weight_dtype
        self.cache: EmbeddingCache | None = None  # set by the run when spec.data.cache is enabled
        self._warned_cpu_encoding = False
        self._encoders: dict[str, Encoder] | None = None
        # The readers report bad samples to it; it checks each file as the layout says (images, clips).
        self.screen = Screen(spec.data.skip_bad, LAYOUTS[spec.data.layout].check(spec))
        # Of the training images (the classifier may take its model's): (width, height), and the side of
        # a square of that area (what sizes planning-like arithmetic and buckets).
        self.size, self.resolution = spec.size, spec.resolution
        self.trainable: Trainable  # what trains and how it is saved: set by each family's __init__

    # --- data: through the layout of spec.data.layout (data.layouts) ---------------------------

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.spec.data.layout]

    def read_samples(self) -> list:
        """Every sample of the layout under spec.data.uri (paths and texts, nothing decoded); a bad
        record goes to self.screen.reject, which refuses the job or skips it (spec.data.skipBad)."""
        return self.layout.read_samples(self.spec, self.screen)

    def make_dataset(self, samples: list, training: bool) -> torch.utils.data.Dataset:
        """A data set over `samples` whose items are looked up by (epoch, index) keys.

        training=False: the held-out set, without random augmentations or dropouts.
        """
        return self.layout.dataset(samples, self.image_transform(training), self.spec, training)

    def sample_name(self, sample: Any) -> str:
        """What the held-out split hashes: the sample's file relative to spec.data.uri, so the split
        is the same wherever a node copies, streams or mounts the data set (an absolute path would
        give each node, and each restarted pod, a split of its own)."""
        return sample_name(self.spec, sample)

    def build_datasets(self, samples: list | None = None
                       ) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
        """(training, held out or None) from `samples` (default: read_samples()): the layout's
        held-out file where it names one, else spec.validation.heldOutFraction of the samples."""
        samples = self.read_samples() if samples is None else samples
        samples, held_out = training_and_held_out(self.spec, samples, self.screen)
        return self.make_dataset(samples, True), (self.make_dataset(held_out, False) if held_out else None)

    def collate(self, items: list[dict]) -> dict:
        """Stack items into a batch."""
        return self.layout.collate(items)

    # --- model --------------------------------------------------------------------------------

    @property
    def trainable_module(self) -> torch.nn.Module:
        """The module whose gradients are synchronised across processes (wrapped by Accelerate)."""
        return self.trainable.module

    def frozen_models(self) -> dict[str, torch.nn.Module]:
        """Every frozen model the family loaded to encode its inputs, by name (its subfolder): text
        encoders, the VAE, PMG's language model; not the trained module, nor a frozen denoiser the
        step trains through (PMG's UNet). None by default."""
        return {}

    @property
    def encoder_device(self) -> torch.device:
        """Where the frozen encoders live through the training steps: the family's device, or the
        CPU when spec.model.encoderDevice says so (kubetune_api.spec.encoders_on_gpu: with a filled
        embedding cache the steps read their outputs and never run them)."""
        return self.device if encoders_on_gpu(self.spec) else torch.device("cpu")

    def place_frozen(self, device: torch.device | None = None) -> None:
        """Freeze every frozen model (no gradients, eval mode) and put it on `device` (default: the
        encoder device; the models the step runs, needed_in_step, stay on the family's device).
        Called once after the family's __init__; the one place frozen models move."""
        for name, model in self.frozen_models().items():
            where = self.device if name in self.needed_in_step else device or self.encoder_device
            model.requires_grad_(False).to(where).eval()

    @contextmanager
    def frozen_on_device(self):
        """The frozen models on the family's device for a while (validation samples through the
        pipeline), then back where the training steps keep them (their GPU memory released)."""
        if self.encoder_device == self.device:
            yield
            return
        self.place_frozen(self.device)
        try:
            yield
        finally:
            self.place_frozen()
            torch.cuda.empty_cache()

    def encoders(self) -> dict[str, Encoder]:
        """The frozen encoders whose per-sample outputs the embedding cache may keep; built once (an
        encoder's identity reads its model's files)."""
        if self._encoders is None:
            self._encoders = self.build_encoders()
        return self._encoders

    def build_encoders(self) -> dict[str, Encoder]:
        """The family's encoders (see encoders()); none by default."""
        return {}

    def encode(self, name: str, inputs: list[Any], variants: list[list[Any]] | None = None) -> Encoded:
        """Run one frozen encoder on per-sample inputs, through the cache when there is one (which
        also stores each new input's `variants[i]`, the other forms augmentation may draw)."""
        encoder = self.encoders()[name]
        if self.cache is None:
            encoded = encoder.encode(inputs)
        else:
            misses = self.cache.misses
            encoded = self.cache.encode(encoder, inputs, variants)
            if self.cache.misses > misses and self.encoder_device != self.device and not self._warned_cpu_encoding:
                self._warned_cpu_encoding = True
                log.warning("embedding cache miss while the encoders are on the CPU (spec.model.encoderDevice): "
                            "it is encoded there, slowly; fill the cache before training (kubetune train --cache-only)")
        return {key: to_device(value, self.device) for key, value in encoded.items()}

    def image_transform(self, training: bool) -> ImageTransform:
        """Resize to self.size, crop and flip as spec.data says (held-out data: centre crop,
        no flip). With the embedding cache on, a random crop is chosen once per image, so its
        latents are reusable."""
        data = self.spec.data
        random_crop = training and not data.center_crop
        return ImageTransform(self.size, not random_crop, data.random_flip and training,
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

    def encode_images_and_captions(self, batch: dict) -> dict[str, Encoded]:
        """A text-to-image batch's "latents" (of its pixel values) and "text" (of its captions), each
        stored in the cache with the forms flips and caption dropout may draw in another epoch."""
        pixels = list(batch["pixel_values"])
        return {"latents": self.encode("latents", pixels, self.mirror_variants(pixels)),
                "text": self.encode("text", batch["captions"],
                                    self.caption_variants(batch["captions"], batch["full_captions"]))}

    @abstractmethod
    def compute_loss(self, model: torch.nn.Module, batch: dict, random: SampleRandom) -> torch.Tensor:
        """The mean training loss over the batch's samples; `model` is the prepared trainable module.

        Every random draw (noise, timesteps, latent samples) comes from `random`, one generator
        per sample, so the loss of a sample does not depend on the rest of its batch."""

    def save_weights(self, out_dir: Path, trained: dict[str, torch.Tensor]) -> list[Path]:
        """Write the trained weights in the family's standard format; return the files written.

        `trained`: every trained parameter whole, on the CPU, by its name in trainable_module
        (checkpointing.full_trained_state gathers them, from shards under FSDP); written in
        spec.adapter.saveDtype (the training precision by default)."""
        dtype = SAVE_DTYPES[self.spec.save_dtype]
        return self.trainable.save(out_dir, {name: value.to(dtype) if value.is_floating_point() else value
                                             for name, value in trained.items()})

    def enable_gradient_checkpointing(self) -> None:
        """Checkpoint what the backward pass runs through: by default the trained module."""
        enable_gradient_checkpointing(self.trainable_module)

    # --- validation ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batches: list[tuple[dict, SampleRandom]]) -> dict[str, float]:
        """Held-out metrics; by default the loss over every held-out sample, each with the same
        draws at every validation (so two checkpoints compare fairly)."""
        total = sum(self.compute_loss(model, batch, random).item() * len(random) for batch, random in batches)
        return {"loss": total / sum(len(random) for _, random in batches)}

    # What `kubetune evaluate` measures: False, images generated from held-out prompts against the
    # held-out images (kubetune_trainer.results.run_evaluation); True, the family's predictions against the
    # labels (a family with predict() and load_trained(), the classifier).
    evaluates_predictions = False

    def sample_images(self, model: torch.nn.Module, held_out: list[dict], draw: Draw) -> list:
        """PIL images (a video family's: sample_clips.Clip) of `draw` (its prompts, else the held-out
        samples it names among the `held_out` batches), for TensorBoard, the run's samples and `kubetune
        generate`; none by default."""
        return []

    def sample_base_images(self, model: torch.nn.Module, held_out: list[dict], draw: Draw) -> list:
        """What the base model alone draws from the inputs sample_images would take (kubetune generate
        --base): by default sample_images before any trained weights are loaded, which is the base (a
        LoRA starts at zero; a whole model as loaded). A family whose trained parts start elsewhere says
        how its base samples."""
        return self.sample_images(model, held_out, draw)

    def image_metrics(self, images: list, held_out: list[dict], draw: Draw, clip) -> dict[str, float]:
        """What `clip` (evaluation.ClipScorer) says of the images sample_images drew from `held_out` and `draw`
        (kubetune_api.families lists each family's); none by default."""
        return {}

    # --- trainable state ----------------------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.trainable_module.parameters() if p.requires_grad]

