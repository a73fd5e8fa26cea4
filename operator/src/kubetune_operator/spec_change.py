"""What a change to a started TrainingJob's spec does: a pure decision, applied by the reconcile (decision.py).

A started run keeps the spec it started with, with two exceptions:

  * spec.suspend, at any time: the pods stop (each takes a last checkpoint) or start again;
  * the job's size (spec.resources.nodes, spec.resources.gpusPerNode, spec.distributed.processesPerNode),
    while no pod runs: in the apply that suspends the job, while it is suspended, or in the apply that
    resumes it. The trainer resumes a checkpoint at any number of processes, keeping the global batch.

The size is compared with what the job runs now (the trainer config the operator applied), not only
with the previous spec: a size change refused while the job ran is applied when it is next suspended.
Other fields are compared with the previous spec, as kopf reports them; they never reach the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kubetune_api.manifest import describe_errors
from kubetune_api.spec import TrainingJob, TrainingJobSpec

# The fields that set the job's size, as manifest paths under spec.
SIZE_FIELDS = ("resources.nodes", "resources.gpusPerNode", "distributed.processesPerNode")


@dataclass(frozen=True)
class Size:
    """How many pods and processes a job runs."""

    nodes: int
    processes_per_node: int
    gpus_per_node: int

    @classmethod
    def of(cls, spec: TrainingJobSpec) -> "Size":
        return cls(spec.resources.nodes, spec.processes_per_node, spec.resources.gpus_per_node)

    def describe(self) -> str:
        """e.g. "2x2 processes" (CPU) or "2x8 GPUs": nodes x per node."""
        unit = f"GPU{'s' if self.nodes * self.gpus_per_node > 1 else ''}" if self.gpus_per_node else \
            f"process{'es' if self.nodes * self.processes_per_node > 1 else ''}"
        return f"{self.nodes}x{self.processes_per_node} {unit}"


@dataclass(frozen=True)
class SpecChange:
    """What to do about a spec change; `refused` set means: nothing, and say why."""

    suspend: bool | None = None  # the child's new suspend state, when spec.suspend changed
    resized: TrainingJob | None = None  # what the job runs from now on, when its size changes
    size_from: Size | None = None
    size_to: Size | None = None
    refused: str | None = None

    @property
    def resize_message(self) -> str:
        return (f"resized from {self.size_from.describe()} to {self.size_to.describe()}; "
                "the run continues from its latest checkpoint")


def changed_paths(old: dict, new: dict) -> list[str]:
    """Manifest paths (under spec) whose values differ, defaults filled in on both sides."""
    before, after = _leaves(_normalized(old)), _leaves(_normalized(new))
    return sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))


def decide(old: dict, new: dict, applied: TrainingJob, child_suspended: bool) -> SpecChange:
    """The decision for a spec that changed from OLD to NEW (spec dicts, as kopf reports them).

    applied: the job as the trainer runs it (its config); child_suspended: the child job is
    suspended now (no pods will run until it is resumed), e.g. by an earlier spec.suspend.
    """
    try:
        wanted = TrainingJob.model_validate({**_header(applied), "spec": new})
    except ValidationError as err:
        return SpecChange(refused="the new spec is invalid: " + "; ".join(describe_errors(err)))
    changed = changed_paths(old, new)
    frozen = frozen_paths(changed)
    if frozen:
        return SpecChange(refused=frozen_refusal(frozen))
    suspend = wanted.spec.suspend if "suspend" in changed else None
    size_from, size_to = Size.of(applied.spec), Size.of(wanted.spec)
    if size_from == size_to:
        return SpecChange(suspend=suspend)
    if not (wanted.spec.suspend or child_suspended):
        return SpecChange(refused=(
            f"the job's size changed from {size_from.describe()} to {size_to.describe()} while it runs; "
            "suspend first: set spec.suspend to true, wait for phase Suspended, then change the size and resume "
            "(spec.suspend false). The run continues from its latest checkpoint at the new size."))
    try:
        resized = with_size(applied, wanted.spec)
    except ValidationError as err:
        return SpecChange(refused="the new size does not fit the running job's spec: "
                                  + "; ".join(describe_errors(err)))
    return SpecChange(suspend=suspend, resized=resized, size_from=size_from, size_to=size_to)


def frozen_paths(changed: list[str]) -> list[str]:
    return [path for path in changed if path != "suspend" and path not in SIZE_FIELDS]


def frozen_refusal(frozen: list[str]) -> str:
    return (f"spec.{', spec.'.join(frozen)} changed after the run started; a running job keeps the spec it "
            "started with. Delete and re-create the TrainingJob (or create one under a new name) to train with "
            "the new spec; spec.suspend can be changed at any time, and the job's size "
            f"(spec.{', spec.'.join(SIZE_FIELDS)}) while it is suspended.")


def against_applied(applied: TrainingJob, spec: dict, child_suspended: bool) -> SpecChange:
    """The level-triggered decision: the spec as it is now against the job the trainer runs (APPLIED).

    Fields frozen since the start that differ are refused (and keep being, until the spec is put
    back); unlike an edge-triggered decision, that refusal does not block suspend or a size change
    made later: those are decided as if the frozen fields were still as applied, and both messages
    are joined, so a job with a refused edit can still be suspended.
    """
    old = applied.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    change = decide(old, spec, applied, child_suspended)
    frozen = frozen_paths(changed_paths(old, spec)) if change.refused else []
    if not frozen:
        return change
    rest = decide(old, _with_leaves(_normalized(spec), _normalized(old), frozen), applied, child_suspended)
    return SpecChange(suspend=rest.suspend, resized=rest.resized, size_from=rest.size_from, size_to=rest.size_to,
                      refused="; ".join(filter(None, [frozen_refusal(frozen), rest.refused])))


def _with_leaves(tree: dict, source: dict, paths: list[str]) -> dict:
    """TREE with the leaves at PATHS (dotted) taken from SOURCE (removed where SOURCE has none)."""
    import copy

    result = copy.deepcopy(tree)
    for path in paths:
        *parents, leaf = path.split(".")
        into, found = result, source
        for key in parents:
            into = into.setdefault(key, {}) if isinstance(into, dict) else {}
            found = found.get(key, {}) if isinstance(found, dict) else {}
        if isinstance(found, dict) and leaf in found:
            into[leaf] = found[leaf]
        elif isinstance(into, dict):
            into.pop(leaf, None)
    return result


def with_size(applied: TrainingJob, spec: TrainingJobSpec) -> TrainingJob:
    """APPLIED with the size (and suspend) of SPEC, validated again: nothing else of SPEC gets in."""
    document = applied.model_dump(mode="json", by_alias=True, exclude_none=True)
    document["spec"]["suspend"] = spec.suspend
    document["spec"].setdefault("resources", {}).update(nodes=spec.resources.nodes,
                                                        gpusPerNode=spec.resources.gpus_per_node)
    distributed = document["spec"].setdefault("distributed", {})
    distributed.pop("processesPerNode", None)
    if spec.distributed.processes_per_node is not None:
        distributed["processesPerNode"] = spec.distributed.processes_per_node
    return TrainingJob.model_validate(document)


def with_suspend(applied: TrainingJob, suspend: bool) -> TrainingJob:
    """APPLIED with spec.suspend set: what the ConfigMap records once a suspend or resume is applied."""
    return applied.model_copy(update={"spec": applied.spec.model_copy(update={"suspend": suspend})})


def _header(job: TrainingJob) -> dict:
    return job.model_dump(mode="json", by_alias=True, exclude_none=True, include={"api_version", "kind", "metadata"})


def _normalized(spec: dict) -> dict:
    """The spec with every default filled in, so that writing a default out is no change; as given if invalid."""
    try:
        return TrainingJobSpec.model_validate(spec).model_dump(mode="json", by_alias=True)
    except ValidationError:
        return spec


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted path: value} for every non-mapping value (lists count as one value)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    leaves: dict[str, Any] = {}
    for key, value in tree.items():
        leaves.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return leaves
