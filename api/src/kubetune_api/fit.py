"""A coarse, torch-free "will it fit?" for the operator (admission warning, FitsGpu condition).

The operator's image has no torch, so it cannot build models the way `kubetune plan` does. It
estimates from a table of each family's standard architecture instead: parameter counts, and the
bytes of activations and backward working memory per step, per sample and per sample-pixel,
calibrated from the meta-device estimator (`python -m kubetune_trainer.planning.profiles` prints
the table; tests/trainer/test_fit_profiles.py checks it agrees within 10%). The same memory rules
(kubetune_api.memory_rules) and the same fixes (kubetune_api.fixes) serve both. A job whose
spec.model.pretrained is not the family's standard architecture gets the standard's estimate;
`kubetune plan` reads the real one.
"""
from __future__ import annotations

from dataclasses import dataclass

from kubetune_api.fixes import suggest, world_size
from kubetune_api.memory_rules import (CUDA_OVERHEAD_BYTES, EMA_BYTES, GIB, PRECISION_BYTES, QUANTIZED_LINEAR_BYTES,
                                       TRAINED_WEIGHT_BYTES, optimizer_state_bytes, optimizer_step_bytes)
from kubetune_api.quantity import parse_quantity
from kubetune_api.spec import TrainingJobSpec

# Activations in fp32 ("no" mixed precision) against the bf16 calibration: every saved tensor doubles.
FP32_ACTIVATION_FACTOR = 2.0
# The classifier's standard architecture (ViT-B/16) trains at its own 224 px when data.resolution is unset.
VIT_IMAGE_SIZE = 224


@dataclass(frozen=True)
class Dynamic:
    """Bytes of activations saved for backward plus backward's working memory, in bf16 with autocast:
    per_step + batch * (per_sample + per_pixel * resolution**2)."""

    per_step: float
    per_sample: float
    per_pixel: float

    def bytes(self, batch: int, resolution: int) -> float:
        return self.per_step + batch * (self.per_sample + self.per_pixel * resolution * resolution)


@dataclass(frozen=True)
class FamilyProfile:
    trained_module: int     # parameters of the module DDP wraps / FSDP shards, before LoRA (the denoiser)
    linear_weights: int     # of which in Linear weights (what nf4 and fp8 store quantized)
    frozen: int             # parameters of every other model the trainer loads (encoders, VAE, LM)
    lora_per_rank: int      # LoRA parameters per unit of rank on the default target modules
    adapter: int            # trained parameters besides a LoRA: PMG's adapter, the classifier's new head
    largest_unit: int       # parameters of the largest block FSDP gathers at once
    loads_fp32: bool        # the trained module loads in fp32 whatever the precision (the classifier)
    dynamic: dict           # (adapter type, gradient checkpointing) -> Dynamic


# Calibrated with `python -m kubetune_trainer.planning.profiles` (the reference architectures of
# kubetune_trainer.reference_models, bf16, default LoRA targets, the families' default options).
PROFILES: dict[str, FamilyProfile] = {
    "sd15": FamilyProfile(
        trained_module=859_520_964, linear_weights=270_049_280, frozen=206_714_343, lora_per_rank=199_296,
        adapter=0, largest_unit=258_330_880, loads_fp32=False,
        dynamic={
            ("lora", False): Dynamic(3.324e+06, 7.683e+06, 4477),
            ("lora", True): Dynamic(1.395e+05, 4.63e+05, 1133),
            ("full", False): Dynamic(1.679e+09, 4.042e+06, 5058),
            ("full", True): Dynamic(2.484e+08, -7.929e+06, 1196),
        },
    ),
    "sdxl": FamilyProfile(
        trained_module=2_567_463_684, linear_weights=2_232_647_680, frozen=901_374_183, lora_per_rank=1_451_520,
        adapter=0, largest_unit=1_206_568_960, loads_fp32=False,
        dynamic={
            ("lora", False): Dynamic(2.076e+07, 6.996e+07, 7395),
            ("lora", True): Dynamic(5.76e+04, 7.312e+06, 823.8),
            ("full", False): Dynamic(4.442e+09, 2.602e+07, 8735),
            ("full", True): Dynamic(2.608e+08, -2.662e+07, 891),
        },
    ),
    "flux-kontext": FamilyProfile(
        trained_module=11_901_408_320, linear_weights=11_898_322_944, frozen=4_969_190_819, lora_per_rank=1_167_360,
        adapter=0, largest_unit=339_831_296, loads_fp32=False,
        dynamic={
            ("lora", False): Dynamic(2.123e+07, 3.005e+09, 4.98e+04),
            ("lora", True): Dynamic(3.017e+06, 2.53e+08, 4189),
            ("full", False): Dynamic(2.377e+10, 5.006e+09, 7.656e+04),
            ("full", True): Dynamic(7.769e+08, 3.107e+08, 4957),
        },
    ),
    "qwen-image-edit": FamilyProfile(
        trained_module=20_430_401_088, linear_weights=20_424_818_688, frozen=8_419_059_187, lora_per_rank=1_474_560,
        adapter=0, largest_unit=339_831_296, loads_fp32=False,
        dynamic={
            ("lora", False): Dynamic(2.659e+07, 6.605e+08, 7.145e+04),
            ("lora", True): Dynamic(3.539e+06, 4.59e+07, 4974),
            ("full", False): Dynamic(4.085e+10, 1.341e+09, 1.23e+05),
            ("full", True): Dynamic(7.617e+08, 5.943e+07, 5997),
        },
    ),
    "pmg": FamilyProfile(
        trained_module=859_520_964, linear_weights=270_049_280, frozen=6_945_129_959, lora_per_rank=0,
        adapter=3_680_512, largest_unit=3_680_512, loads_fp32=False,
        dynamic={
            ("lora", False): Dynamic(6.291e+06, 1.097e+09, 2961),
            ("lora", True): Dynamic(1.153e+07, 6.687e+07, 931.2),
            ("full", False): Dynamic(6.291e+06, 1.097e+09, 2961),
            ("full", True): Dynamic(1.153e+07, 6.687e+07, 931.2),
        },
    ),
    "classifier": FamilyProfile(
        trained_module=86_567_656, linear_weights=85_702_656, frozen=0, lora_per_rank=36_864,
        adapter=769_000, largest_unit=7_087_872, loads_fp32=True,
        dynamic={
            ("lora", False): Dynamic(1.684e+08, 0, 1066),
            ("lora", True): Dynamic(1.574e+07, 0, 277.9),
            ("full", False): Dynamic(1.726e+08, 0, 1589),
            ("full", True): Dynamic(1.687e+07, 0, 326),
        },
    ),
}


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


def _trained(spec: TrainingJobSpec, profile: FamilyProfile) -> int:
    if spec.adapter.type == "full":  # never pmg: the families table refuses a full pmg
        return profile.trained_module + profile.adapter
    return spec.adapter.rank * profile.lora_per_rank + profile.adapter


class CoarseEstimator:
    """estimate(spec, world, strategy) from the profile table, as kubetune_api.fixes asks."""

    def estimate(self, spec: TrainingJobSpec, world: int, strategy: str) -> CoarseEstimate:
        profile = PROFILES[spec.model.family]
        training = spec.training
        precision = PRECISION_BYTES[training.mixed_precision]
        full = spec.adapter.type == "full" and spec.model.family != "pmg"
        module_bytes = TRAINED_WEIGHT_BYTES if full or profile.loads_fp32 else precision
        quantized = QUANTIZED_LINEAR_BYTES.get(spec.model.quantization or "", module_bytes)
        base = profile.linear_weights * quantized + (profile.trained_module - profile.linear_weights) * module_bytes
        trained = _trained(spec, profile)
        module = base + (0 if full else trained * TRAINED_WEIGHT_BYTES)
        # Many small LoRA tensors (8-bit Adam keeps 32-bit state below 4096 elements); few large ones otherwise.
        large = full or spec.model.family == "pmg"
        state = (optimizer_state_bytes(training.optimizer, trained, TRAINED_WEIGHT_BYTES, training.sgd_momentum)
                 if large else trained * optimizer_state_bytes(training.optimizer, 1, TRAINED_WEIGHT_BYTES,
                                                               training.sgd_momentum))
        gradients = trained * TRAINED_WEIGHT_BYTES
        ema = EMA_BYTES * trained if training.ema_decay else 0
        step = optimizer_step_bytes(training.optimizer, gradients, 0, on_gpu=True)
        dynamic = profile.dynamic[(spec.adapter.type if full else "lora", training.gradient_checkpointing)].bytes(
            training.batch_size, spec.resolution or VIT_IMAGE_SIZE)
        if training.mixed_precision == "no":
            dynamic *= FP32_ACTIVATION_FACTOR
        if strategy == "fsdp" and world > 1:
            module, gradients, state, ema, step = (-(-int(x) // world) for x in (module, gradients, state, ema, step))
            dynamic += 2 * profile.largest_unit * precision  # the block computed and the next, gathered
            if spec.distributed.cpu_offload:
                module, gradients, state, ema = 0, 0, 0, 0
        elif world > 1:
            gradients *= 2  # DDP's gradient buckets
        return CoarseEstimate(weights=int(module + profile.frozen * precision), gradients=int(gradients),
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
    if spec.resources.gpus_per_node == 0 or spec.model.family not in PROFILES:
        return None
    estimator = CoarseEstimator()
    world = world_size(spec)
    strategy = "fsdp" if spec.distributed.strategy == "fsdp" else "ddp"
    estimate = estimator.estimate(spec, world, strategy)
    if estimate.fits(capacity):
        return None
    if spec.distributed.strategy == "auto" and world > 1:
        sharded = estimator.estimate(spec, world, "fsdp")
        if sharded.fits(capacity):
            return None  # the trainer will choose fsdp
        estimate = sharded
    fixes = suggest(estimator, spec, capacity, strategy)
    advice = "; ".join(f"{fix.description} (~{fix.estimate.total / GIB:.0f} GiB: "
                       f"{', '.join(fix.overrides)})" for fix in fixes[:3])
    return (f"estimated {estimate.total / GIB:.0f} GiB per GPU for the standard {spec.model.family} architecture, "
            f"more than the {capacity / GIB:.0f} GiB of one GPU (spec.resources.gpuMemory); "
            + (f"would fit: {advice}" if advice else "lower spec.data.resolution or spec.training.batchSize")
            + ". `kubetune plan -f JOB.yaml` estimates from the model's own configs.")
