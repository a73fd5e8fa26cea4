"""A coarse, torch-free "will it fit?" for the operator (admission warning, FitsGpu condition).

The operator's image has no torch, so it cannot build models the way `kubetune plan` does. It
estimates from each family's row instead (kubetune_api.families: FamilyInfo.profile, its standard
architecture in numbers): parameter counts, and the bytes of activations and backward working
memory per step, per sample and per sample-pixel, calibrated from the meta-device estimator
(`python -m kubetune_trainer.planning.profiles` prints them; tests/trainer/test_fit_profiles.py
checks they agree within 10%). The same memory rules
(kubetune_api.memory_rules) and the same fixes (kubetune_api.fixes) serve both. A job whose
spec.model.pretrained is not the family's standard architecture gets the standard's estimate;
`kubetune plan` reads the real one.
"""
from __future__ import annotations

from dataclasses import dataclass

from kubetune_api.families import FAMILIES, FamilyProfile
from kubetune_api.fixes import suggest, world_size
from kubetune_api.memory_rules import (CUDA_OVERHEAD_BYTES, EMA_BYTES, GIB, PRECISION_BYTES, QUANTIZED_LINEAR_BYTES,
                                       TRAINED_WEIGHT_BYTES, optimizer_state_bytes, optimizer_step_bytes)
from kubetune_api.quantity import parse_quantity
from kubetune_api.spec import TrainingJobSpec, encoders_on_gpu
from kubetune_api.strategy import resolve_strategy

# Activations in fp32 ("no" mixed precision) against the bf16 calibration: every saved tensor doubles.
FP32_ACTIVATION_FACTOR = 2.0


@dataclass(frozen=True)
class CoarseEstimate:
    weights: int
    gradients: int
    optimizer: int
    ema: int
    dynamic: int            # activations + backward working memory
    step_working: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.ema + self.overhead
                + max(self.dynamic, self.step_working))

    def fits(self, capacity: int) -> bool:
        return self.total <= capacity


def _trained(spec: TrainingJobSpec, profile: FamilyProfile, full: bool) -> int:
    if full:
        return profile.trained_module + profile.adapter
    return spec.adapter.rank * profile.lora_per_rank + profile.adapter


class CoarseEstimator:
    """estimate(spec, world, strategy) from the profile table, as kubetune_api.fixes asks."""

    def estimate(self, spec: TrainingJobSpec, world: int, strategy: str) -> CoarseEstimate:
        family = FAMILIES[spec.model.family]
        profile = family.profile
        training = spec.training
        precision = PRECISION_BYTES[training.mixed_precision]
        # A family training parts of its own (PMG) trains them whatever spec.adapter says.
        full = spec.adapter.type == "full" and not family.own_adapter
        module_bytes = TRAINED_WEIGHT_BYTES if full or profile.loads_fp32 else precision
        quantized = QUANTIZED_LINEAR_BYTES.get(spec.model.quantization or "", module_bytes)
        base = profile.linear_weights * quantized + (profile.trained_module - profile.linear_weights) * module_bytes
        trained = _trained(spec, profile, full)
        module = base + (0 if full else trained * TRAINED_WEIGHT_BYTES)
        # Many small LoRA tensors (8-bit Adam keeps 32-bit state below 4096 elements); few large ones otherwise
        # (a whole model, or a family's own parts: PMG's prefix and mapping layer).
        large = full or family.own_adapter
        state = (optimizer_state_bytes(training.optimizer, trained, TRAINED_WEIGHT_BYTES, training.sgd_momentum)
                 if large else trained * optimizer_state_bytes(training.optimizer, 1, TRAINED_WEIGHT_BYTES,
                                                               training.sgd_momentum))
        gradients = trained * TRAINED_WEIGHT_BYTES
        ema = EMA_BYTES * trained if training.ema_decay else 0
        step = optimizer_step_bytes(training.optimizer, gradients, 0, on_gpu=True)
        dynamic = profile.dynamic[(spec.adapter.type if full else "lora", training.gradient_checkpointing)].bytes(
            training.batch_size, spec.resolution or profile.image_size)
        if training.mixed_precision == "no":
            dynamic *= FP32_ACTIVATION_FACTOR
        if strategy == "fsdp" and world > 1:
            module, gradients, state, ema, step = (-(-int(x) // world) for x in (module, gradients, state, ema, step))
            dynamic += 2 * profile.largest_unit * precision  # the block computed and the next, gathered
            if spec.distributed.cpu_offload:
                module, gradients, state, ema = 0, 0, 0, 0
        elif world > 1:
            gradients *= 2  # DDP's gradient buckets
        frozen = profile.frozen * precision if encoders_on_gpu(spec) else 0  # else in CPU memory while training
        return CoarseEstimate(weights=int(module + frozen), gradients=int(gradients),
                              optimizer=int(state), ema=int(ema), dynamic=int(dynamic), step_working=int(step),
                              overhead=CUDA_OVERHEAD_BYTES)


def coarse_estimate(spec: TrainingJobSpec) -> CoarseEstimate:
    """Per-GPU bytes of the job under its strategy (auto counts as ddp: it shards only when ddp does not fit)."""
    strategy = "fsdp" if spec.distributed.strategy == "fsdp" else "ddp"
    return CoarseEstimator().estimate(spec, world_size(spec), strategy)


def gpu_memory(spec: TrainingJobSpec, default: str) -> int:
    """Bytes of one GPU: spec.resources.gpuMemory, else the operator's default."""
    declared = spec.resources.gpu_memory
    return parse_quantity(declared or default, "spec.resources.gpuMemory" if declared else "the default GPU memory")


def fit_problem(spec: TrainingJobSpec, capacity: int) -> str | None:
    """Why the job will not fit its GPUs, with the estimate and what would fit; None when it fits
    (or runs on the CPU, or strategy auto can shard it over the job's GPUs)."""
    if spec.resources.gpus_per_node == 0 or FAMILIES[spec.model.family].profile is None:
        return None
    estimator = CoarseEstimator()
    world = world_size(spec)
    # The strategy the trainer will run (auto: fsdp where ddp does not fit and sharding is possible).
    strategy = resolve_strategy(spec, world, True, lambda: estimator.estimate(spec, world, "ddp").fits(capacity))
    estimate = estimator.estimate(spec, world, strategy)
    if estimate.fits(capacity):
        return None
    fixes = suggest(estimator, spec, capacity, strategy)
    advice = "; ".join(f"{fix.description} (~{fix.estimate.total / GIB:.0f} GiB: "
                       f"{', '.join(fix.overrides)})" for fix in fixes[:3])
    return (f"estimated {estimate.total / GIB:.0f} GiB per GPU for the standard {spec.model.family} architecture, "
            f"more than the {capacity / GIB:.0f} GiB of one GPU (spec.resources.gpuMemory); "
            + (f"would fit: {advice}" if advice else "lower spec.data.resolution or spec.training.batchSize")
            + ". `kubetune plan -f JOB.yaml` estimates from the model's own configs.")
