"""Will it fit? Per-GPU memory of a training job, from its real architecture on the meta device.

    plan = plan_job(spec, gpu_memory_bytes=80 * 2**30)   # what `kubetune plan` prints
    plan.estimate.total, plan.fits, plan.suggestions
    choose_strategy(spec, world_size, gpu_memory_bytes)  # "ddp" or "fsdp", for strategy: auto
    fits_under_ddp(spec, world_size, gpu_memory_bytes)   # the question behind it (kubetune_api.strategy)

Importing this package builds nothing; the models are built (without weights) when a plan is asked for.

The modules, one purpose each: models (the job's models from config files), weights (bytes
per parameter as held), fake_device and attention (a forward pass as on a GPU, without one),
forwards (each family's training forward), activations (what that forward saves for backward),
estimate (the per-process sum), sharding (FSDP's units). The fixes offered when a job does not
fit are kubetune_api.fixes, shared with the operator's coarse check.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kubetune_api.spec import TrainingJobSpec
from kubetune_api.strategy import resolve_strategy


@dataclass(frozen=True)
class Plan:
    estimate: "MemoryEstimate"
    capacity: int                      # bytes of memory per GPU the plan was made for
    suggestions: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.estimate.fits(self.capacity)


def plan_job(spec: TrainingJobSpec, gpu_memory_bytes: int, world_size: int | None = None,
             device: str | None = None, attention: str = "fused", planner=None) -> Plan:
    """The per-GPU estimate of `spec` under its strategy, and fixes when it does not fit."""
    from kubetune_api.fixes import suggest, world_size as job_world_size
    from kubetune_trainer.planning.estimate import Planner

    device = device or ("cuda" if spec.resources.gpus_per_node > 0 else "cpu")
    world = world_size or job_world_size(spec)
    planner = planner or Planner(device, attention)
    strategy = resolve_strategy(spec, world, device == "cuda",
                                lambda: planner.estimate(spec, world, "ddp").fits(gpu_memory_bytes))
    estimate = planner.estimate(spec, world, strategy)
    fixes = [] if estimate.fits(gpu_memory_bytes) else suggest(planner, spec, gpu_memory_bytes, strategy)
    return Plan(estimate, gpu_memory_bytes, fixes)


def fits_under_ddp(spec: TrainingJobSpec, world_size: int, gpu_memory_bytes: int) -> bool:
    """Whether each of `world_size` GPUs of `gpu_memory_bytes` holds the whole job (ddp). It builds the
    models on the meta device from spec.model.pretrained's config files: give it a local folder."""
    from kubetune_trainer.planning.estimate import Planner

    return Planner("cuda").estimate(spec, world_size, "ddp").fits(gpu_memory_bytes)


def choose_strategy(spec: TrainingJobSpec, world_size: int, gpu_memory_bytes: int) -> str:
    """"ddp" or "fsdp" for a job on `world_size` GPUs of `gpu_memory_bytes` each (strategy auto:
    fsdp when the ddp estimate does not fit)."""
    return resolve_strategy(spec, world_size, True, lambda: fits_under_ddp(spec, world_size, gpu_memory_bytes))


def __getattr__(name: str):
    """MemoryEstimate and Planner without importing torch at package import."""
    if name in ("MemoryEstimate", "Planner"):
        from kubetune_trainer.planning import estimate

        return getattr(estimate, name)
    raise AttributeError(name)
