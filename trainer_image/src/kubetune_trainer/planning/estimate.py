"""Memory one training process holds at the peak of a step: the arithmetic over the measured parts.

The peak comes in one of two phases. At the start of backward every activation saved by the
forward pass is alive, with the gradients flowing through the widest layers (and, with gradient
checkpointing, one block rebuilt); during the optimizer step the gradients and the optimizer's
temporaries are. Weights, optimizer state and the EMA are there throughout, so

    total = weights + optimizer state + EMA + gradients + overhead
            + max(activations + backward working memory, optimizer-step working memory)

Gradients are counted whole in both phases: trained parameters of a LoRA are a few MB, and a
fully trained model's last gradients are ready before its first activations are freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kubetune_api.families import EMBEDDING_CACHE, FAMILIES
from kubetune_api.memory_rules import (CUDA_OVERHEAD_BYTES, EMA_BYTES, optimizer_state_bytes,
                                       optimizer_step_bytes)
from kubetune_api.spec import TrainingJobSpec, encoders_on_gpu
from kubetune_trainer.planning.activations import Activations, measure
from kubetune_trainer.planning.attention import attention_kernel
from kubetune_trainer.planning.fake_device import autocast_on, fake_mode, move_to_fake
from kubetune_trainer.families import definition_for
from kubetune_trainer.planning.models import JobModels, load_models, weight_dtype
from kubetune_trainer.planning.sharding import largest_unit
from kubetune_trainer.planning.weights import parameter_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one process (one GPU) holds at the peak of a training step, by what holds them."""

    device: str                  # "cuda" or "cpu"
    strategy: str                # "ddp" or "fsdp"
    world_size: int              # processes the job runs (FSDP shards over all of them)
    parameters: int              # every model the trainer loads
    trainable_parameters: int
    weights: int
    gradients: int               # with DDP's gradient buckets (several processes)
    optimizer: int
    ema: int
    activations: int             # saved by the forward pass for backward
    backward_working: int        # gradients in flight, a rebuilt checkpointed block, FSDP's gathered blocks
    step_working: int            # the optimizer step's temporaries
    overhead: int                # CUDA context and allocator slack; 0 on the CPU
    host: int = 0                # FSDP cpuOffload: sharded state kept in CPU memory instead
    weights_by_model: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def peak_phase(self) -> str:
        return "backward" if self.activations + self.backward_working >= self.step_working else "optimizer step"

    @property
    def total(self) -> int:
        return (self.weights + self.optimizer + self.ema + self.gradients + self.overhead
                + max(self.activations + self.backward_working, self.step_working))

    def fits(self, capacity_bytes: int) -> bool:
        return self.total <= capacity_bytes


def measure_activations(spec: TrainingJobSpec, device: str = "cuda", attention: str = "fused") -> Activations:
    """Run the family's training forward (DEFINITION.forward) on fake tensors of `device` and meter what it saves."""
    definition = definition_for(spec.model.family)
    models = load_models(spec)
    if spec.training.gradient_checkpointing:  # as the family does (ModelFamily.enable_gradient_checkpointing)
        definition.enable_gradient_checkpointing(models.components)
    dtype = weight_dtype(spec)
    mode = fake_mode()
    for model in models.components.values():
        move_to_fake(model, mode, device)
    autocast_dtype = None if dtype == torch.float32 else dtype

    def make(shape, tensor_dtype):
        return torch.empty(shape, dtype=tensor_dtype, device=device)

    def forward():
        with mode, attention_kernel(attention):
            return definition.forward(models.components, spec, make, lambda: autocast_on(device, autocast_dtype),
                                      dtype)

    models.trained_module.train()
    return measure(list(models.components.values()), forward)


# The families' own options blocks (spec.pmg): the models and activations depend on them too.
OWN_OPTIONS = {family.options: True for family in FAMILIES.values() if family.options}


def activation_key(spec: TrainingJobSpec, device: str, attention: str) -> str:
    """What the activations depend on: everything but the strategy, the optimizer and the GPU count."""
    relevant = spec.model_dump(mode="json", include={
        "model": {"family", "pretrained", "experts"}, "adapter": True, "data": {"resolution", "layout"}, **OWN_OPTIONS,
        "training": {"batch_size", "mixed_precision", "gradient_checkpointing"},
    })
    return repr((relevant, device, attention))


class Planner:
    """Estimates for one job and its variants; activations are measured once per variant that changes them."""

    def __init__(self, device: str = "cuda", attention: str = "fused"):
        self.device = device
        self.attention = attention
        self._activations: dict[str, Activations] = {}
        self._models: dict[str, JobModels] = {}

    def activations(self, spec: TrainingJobSpec) -> Activations:
        key = activation_key(spec, self.device, self.attention)
        if key not in self._activations:
            self._activations[key] = measure_activations(spec, self.device, self.attention)
        return self._activations[key]

    def models(self, spec: TrainingJobSpec) -> JobModels:
        key = repr(spec.model_dump(mode="json", include={  # what the models' parameters depend on
            "model": {"family", "pretrained", "experts"}, "adapter": True, **OWN_OPTIONS, "training": {"mixed_precision"}}))
        if key not in self._models:
            self._models[key] = load_models(spec)
        return self._models[key]

    def estimate(self, spec: TrainingJobSpec, world_size: int, strategy: str) -> MemoryEstimate:
        return estimate_from_parts(spec, self.models(spec), self.activations(spec), self.device, world_size, strategy)


def estimate_from_parts(spec: TrainingJobSpec, models: JobModels, activations: Activations, device: str,
                        world_size: int, strategy: str) -> MemoryEstimate:
    """The per-process sum for a strategy: FSDP divides the trained module's state by the process count."""
    on_gpu = device == "cuda"
    training = spec.training
    sizes = {name: parameter_bytes(model, spec.model.quantization if name == models.quantized else None)
             for name, model in models.components.items()}
    trained = sizes[models.trained]
    parameters = sum(s.total for s in sizes.values())
    trainable = sum(s.trained for s in sizes.values())
    state = sum(optimizer_state_bytes(training.optimizer, p.numel(), p.element_size(), training.sgd_momentum)
                for p in models.trained_module.parameters() if p.requires_grad)
    gradients = trained.trained_bytes
    ema = EMA_BYTES * trained.trained if training.ema_decay else 0
    step = optimizer_step_bytes(training.optimizer, trained.trained_bytes, trained.largest_trained, on_gpu)
    backward = 2 * activations.largest + activations.recompute
    notes = []
    weights_by_model = {name: s.bytes for name, s in sizes.items()}
    host = 0
    if strategy == "fsdp" and world_size > 1:
        shards = world_size
        weights_by_model[models.trained] = -(-trained.bytes // shards)
        gradients, state, ema = -(-gradients // shards), int(state // shards), -(-ema // shards)
        step = -(-step // shards)
        unit_bytes, unit_trained = largest_unit(models.trained_module, weight_dtype(spec))
        # The block being computed and the next one, gathered whole; one block's gradients before reduce-scatter.
        backward += 2 * unit_bytes + 4 * unit_trained
        if spec.distributed.cpu_offload:
            host = weights_by_model[models.trained] + gradients + int(state) + ema
            weights_by_model[models.trained], gradients, state, ema = 0, 0, 0, 0
            notes.append("cpuOffload: the trained module's shards, gradients and optimizer state are in CPU memory")
        if spec.training.mixed_precision != "no":
            notes.append("fsdp computes in the training precision throughout (no autocast); the activations are "
                         "measured under autocast, as ddp runs, which keeps some in fp32: a little high for fsdp")
    elif world_size > 1:
        gradients *= 2  # DDP all-reduces through buckets: a second copy of the gradients
    if on_gpu and not encoders_on_gpu(spec):
        frozen = [name for name in weights_by_model if name not in (models.trained, models.quantized)]
        host += sum(weights_by_model[name] for name in frozen)
        notes.append(f"spec.model.encoderDevice {spec.model.encoder_device}: the frozen encoders ({', '.join(frozen)}) "
                     "are in CPU memory while training (validation samples bring them to the GPU for a moment, "
                     "when no gradients are held)")
        weights_by_model.update({name: 0 for name in frozen})
    elif spec.data.cache.enabled and EMBEDDING_CACHE in FAMILIES[spec.model.family].honours:
        notes.append("spec.data.cache is on but the frozen encoders stay on the GPU (spec.model.encoderDevice "
                     "gpu, or a family whose step runs them): they are counted")
    if spec.model.quantization:
        notes.append(f"{spec.model.quantization}: the activations are measured at the unquantized layers' precision")
    return MemoryEstimate(
        device=device, strategy=strategy, world_size=world_size, parameters=parameters,
        trainable_parameters=trainable, weights=sum(weights_by_model.values()), gradients=gradients,
        optimizer=int(state), ema=ema, activations=activations.saved, backward_working=backward,
        step_working=step, overhead=CUDA_OVERHEAD_BYTES if on_gpu else 0, host=host,
        weights_by_model=weights_by_model, notes=tuple(notes),
    )

