"""How a job's processes share the trained model: spec.distributed.strategy resolved, in one place.

`kubetune plan` (kubetune_trainer.planning), the operator's and `validate`'s fit check
(kubetune_api.fit) and the trainer itself (kubetune_trainer.run) all ask this function, so what a plan
reports is what the trainer runs. Torch-free: the memory question is asked through a callable, which
each caller answers with its own estimate (the trainer and `plan` from the model's configs, the fit
check from the family's coarse profile).
"""
from __future__ import annotations

from typing import Callable

from kubetune_api.spec import TrainingJobSpec, fsdp_conflicts


def resolve_strategy(spec: TrainingJobSpec, world_size: int, on_gpu: bool, fits_under_ddp: Callable[[], bool]) -> str:
    """"ddp" or "fsdp": what the job's `world_size` processes run.

    One process has nothing to shard over: ddp, whatever the spec says (the trainer logs that it
    trains unsharded). Otherwise the spec's own choice; for auto, fsdp only on GPUs (on the CPU memory
    is what the pod requests), only where nothing in the spec rules it out (a quantized base, 8-bit
    optimizer state, fp16), and only where the model does not fit one GPU under ddp.
    """
    if world_size == 1:
        return "ddp"
    strategy = spec.distributed.strategy
    if strategy != "auto":
        return strategy
    if not on_gpu or fsdp_conflicts(spec):
        return "ddp"
    return "ddp" if fits_under_ddp() else "fsdp"


def unsharded_note(spec: TrainingJobSpec, world_size: int) -> str | None:
    """Why an explicit fsdp runs unsharded (said in the trainer's log and `kubetune plan`); None otherwise."""
    if spec.distributed.strategy == "fsdp" and world_size == 1:
        return "spec.distributed.strategy fsdp: one process has nothing to shard over; training unsharded"
    return None
