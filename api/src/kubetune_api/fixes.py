"""What would make a job fit its GPUs: each fix applied to the spec and estimated again.

A fix is a list of `--set` overrides, exactly as a user would pass them to `kubetune plan` or
`kubetune train`; the same strings build the variant spec that is re-estimated, so what is
printed is what was computed. Torch-free: `kubetune plan` passes its meta-device estimator, the
operator its coarse one (kubetune_api.fit); either only has to answer `estimate(spec, world, strategy)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kubetune_api.families import FAMILIES, QUANTIZATION
from kubetune_api.manifest import apply_overrides
from kubetune_api.spec import TrainingJobSpec


class Estimator(Protocol):
    def estimate(self, spec: TrainingJobSpec, world: int, strategy: str) -> Any:
        """An estimate with `.total` bytes and `.fits(capacity_bytes)`."""

MAX_GPUS = 64          # the largest FSDP world a suggestion proposes
GPUS_PER_NODE = 8      # a node's GPUs when the job asks for one per node: the common server size


@dataclass(frozen=True)
class Suggestion:
    description: str
    overrides: tuple[str, ...]     # `--set` arguments, e.g. spec.training.gradientCheckpointing=true
    estimate: Any                  # what the estimator gave for the fixed spec


def with_overrides(spec: TrainingJobSpec, overrides: tuple[str, ...]) -> TrainingJobSpec:
    document = {"spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True)}
    return TrainingJobSpec.model_validate(apply_overrides(document, overrides)["spec"])


def world_size(spec: TrainingJobSpec) -> int:
    """Processes of the job: one per GPU on every node (on the CPU, processesPerNode or 1 per node)."""
    per_node = spec.resources.gpus_per_node or spec.distributed.processes_per_node or 1
    return spec.resources.nodes * per_node


def gpu_layouts(spec: TrainingJobSpec) -> list[tuple[int, int]]:
    """(nodes, GPUs per node) to try, fewest GPUs first: nodes like the job's when it has several GPUs
    per node, else up to 8 GPUs on one node, then whole 8-GPU nodes."""
    per_node = spec.resources.gpus_per_node
    if per_node > 1:
        return [(nodes, per_node) for nodes in range(1, MAX_GPUS // per_node + 1)]
    return [(1, gpus) for gpus in range(2, GPUS_PER_NODE + 1)] + [
        (nodes, GPUS_PER_NODE) for nodes in range(2, MAX_GPUS // GPUS_PER_NODE + 1)]


def _without_fsdp_conflicts(spec: TrainingJobSpec) -> tuple[str, ...]:
    """Overrides that drop what FSDP cannot shard (kubetune_api.spec.FSDP_CONFLICTS), in their order."""
    replacements = ("spec.model.quantization=null", "spec.training.optimizer=adamw",
                    "spec.training.mixedPrecision=bf16")
    checks = (spec.model.quantization is not None, spec.training.optimizer == "adamw8bit",
              spec.training.mixed_precision == "fp16")
    return tuple(fix for fix, applies in zip(replacements, checks) if applies)


def _fsdp(planner: Estimator, spec: TrainingJobSpec, capacity: int, extra: tuple[str, ...] = ()
          ) -> Suggestion | None:
    """The fewest GPUs (at least two, at least the job's) over which FSDP fits."""
    overrides = extra + ("spec.distributed.strategy=fsdp",) + _without_fsdp_conflicts(spec)
    sharded = with_overrides(spec, overrides)
    for nodes, per_node in gpu_layouts(spec):
        gpus = nodes * per_node
        if gpus < world_size(spec):
            continue
        estimate = planner.estimate(sharded, gpus, "fsdp")
        if estimate.fits(capacity):
            dropped = [o.split("=")[0].removeprefix("spec.") for o in _without_fsdp_conflicts(spec)]
            note = f" (without {', '.join(dropped)}, which fsdp cannot shard)" if dropped else ""
            layout = (f"spec.resources.nodes={nodes}", f"spec.resources.gpusPerNode={per_node}")
            return Suggestion(f"fsdp over {gpus} GPUs{note}", overrides + layout, estimate)
    return None


def suggest(planner: Estimator, spec: TrainingJobSpec, capacity: int, strategy: str) -> list[Suggestion]:
    """Fixes that fit `capacity` bytes per GPU, cheapest in speed first; combinations only when
    no single fix is enough."""
    world = world_size(spec)
    training = spec.training
    single: list[tuple[str, tuple[str, ...]]] = []
    if not training.gradient_checkpointing:
        single.append(("gradient checkpointing", ("spec.training.gradientCheckpointing=true",)))
    can_quantize = (QUANTIZATION in FAMILIES[spec.model.family].honours and spec.model.quantization != "nf4"
                    and spec.adapter.type == "lora" and strategy == "ddp" and spec.resources.gpus_per_node > 0)
    if can_quantize:
        single.append(("nf4 quantized base", ("spec.model.quantization=nf4",)))
    found: list[Suggestion] = []
    for description, overrides in single:
        variant = with_overrides(spec, overrides)
        estimate = planner.estimate(variant, world, strategy)
        if estimate.fits(capacity):
            found.append(Suggestion(description, overrides, estimate))
    sharded = _fsdp(planner, spec, capacity)
    if sharded:
        found.append(sharded)
    if found:
        return found
    combined = []
    if not training.gradient_checkpointing:
        checkpointing = ("spec.training.gradientCheckpointing=true",)
        if can_quantize:
            both = checkpointing + ("spec.model.quantization=nf4",)
            estimate = planner.estimate(with_overrides(spec, both), world, strategy)
            if estimate.fits(capacity):
                combined.append(Suggestion("gradient checkpointing and an nf4 quantized base", both, estimate))
        sharded = _fsdp(planner, spec, capacity, checkpointing)
        if sharded:
            combined.append(Suggestion(f"gradient checkpointing and {sharded.description}", sharded.overrides,
                                       sharded.estimate))
    return combined
