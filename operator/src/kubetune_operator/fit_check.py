"""Will the job fit its GPUs? The operator's side: a warning at admission, the FitsGpu condition at reconcile.

The estimate is kubetune_api.fit's coarse one (the operator image has no torch to build models);
`kubetune plan` gives the precise per-GPU breakdown from the model's own configs. One GPU's memory
is spec.resources.gpuMemory, else the operator's default (Helm value trainer.gpuMemory).
"""
from __future__ import annotations

from kubetune_api.fit import fit_problem, gpu_memory
from kubetune_api.spec import TrainingJob
from kubetune_operator import status

CONDITION = "FitsGpu"


def fit_warning(job: TrainingJob, default_gpu_memory: str) -> str | None:
    """The admission warning for a job that will not fit, or None."""
    problem = fit_problem(job.spec, gpu_memory(job.spec, default_gpu_memory))
    return f"{CONDITION}: {problem}" if problem else None


def fits_gpu_conditions(current_status: dict, job: TrainingJob, default_gpu_memory: str, now: str) -> list[dict] | None:
    """status.conditions with FitsGpu set from the estimate, or None when nothing changes (or a CPU job)."""
    if job.spec.resources.gpus_per_node == 0:
        return None
    problem = fit_problem(job.spec, gpu_memory(job.spec, default_gpu_memory))
    conditions = list(current_status.get("conditions") or [])
    if problem:
        updated = status.set_condition(conditions, CONDITION, "False", "InsufficientGpuMemory", problem, now)
    else:
        updated = status.set_condition(conditions, CONDITION, "True", "EstimateFits",
                                       "the coarse per-GPU estimate fits spec.resources.gpuMemory", now)
    return None if updated == conditions else updated
