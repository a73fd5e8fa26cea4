"""The TrainingSweep API: a search over spec paths of a TrainingJob template (torch-free).

A sweep's parameters name fields of the template's spec in the manifest's own spelling
(`training.learningRate`), each with a distribution; every path is checked against the
TrainingJob schema and every value a distribution can give (its bounds, its choices) against the
field's own rules, so a bad search space is refused before any trial runs, naming the parameter.
The objective is a metric the template's family reports (kubetune_api.families).
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, StrictBool, ValidationError, field_validator, model_validator

from kubetune_api.contract import API_GROUP_VERSION
from kubetune_api.families import FAMILIES
from kubetune_api.manifest import field_by_alias, model_in, parse_manifest, read_document
from kubetune_api.spec import ObjectMeta, TrainingJobSpec
from kubetune_api.spec_base import SpecModel as _Model

Scalar = Union[StrictBool, int, float, str]

# Objective -> what the trainer logs it as: train/loss, or validation/<name> at validation steps.
TRAINING_LOSS = "loss"
VALIDATION_METRICS = {"validation_loss": "loss", "accuracy": "accuracy", "precision": "precision",
                      "recall": "recall", "f1": "f1", "clip_score": "clip_score", "clip_directional": "clip_directional"}
LOWER_IS_BETTER = {"loss", "validation_loss"}
CLIP_METRICS = {"clip_score", "clip_directional"}
GRID_LIMIT = 10_000


class Distribution(_Model):
    """Exactly one of choice, uniform, logUniform, intRange, floatRange (step: the ranges' grid)."""

    choice: Optional[list[Scalar]] = Field(default=None, min_length=1, max_length=1000,
                                           description="The values to try.")
    uniform: Optional[list[float]] = Field(default=None, min_length=2, max_length=2, description="[low, high].")
    log_uniform: Optional[list[float]] = Field(
        default=None, min_length=2, max_length=2, description="[low, high], drawn uniformly in log space (low > 0).")
    int_range: Optional[list[int]] = Field(
        default=None, min_length=2, max_length=2, description="[low, high] integers, both included, every step.")
    float_range: Optional[list[float]] = Field(
        default=None, min_length=2, max_length=2, description="[low, high], both included, every step.")
    step: Optional[Union[int, float]] = Field(default=None, gt=0, description="intRange (default 1) and floatRange.")

    @model_validator(mode="after")
    def _one_kind(self) -> "Distribution":
        kinds = [name for name in ("choice", "uniform", "log_uniform", "int_range", "float_range")
                 if getattr(self, name) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of choice, uniform, logUniform, intRange or floatRange"
                             + (f" (got {', '.join(kinds)})" if kinds else ""))
        if self.step is not None and self.kind not in ("int_range", "float_range"):
            raise ValueError("step applies to intRange and floatRange only")
        if self.kind == "float_range" and self.step is None:
            raise ValueError("floatRange needs a step (or use uniform)")
        if self.kind == "int_range" and self.step is not None and self.step != int(self.step):
            raise ValueError("an intRange's step is an integer")
        if self.kind != "choice":
            low, high = getattr(self, self.kind)
            if not low < high:
                raise ValueError(f"[{low}, {high}]: low must be below high")
            if self.kind == "log_uniform" and low <= 0:
                raise ValueError(f"logUniform [{low}, {high}]: low must be above 0")
            if self.kind == "float_range" and not math.isfinite((high - low) / self.step):
                raise ValueError(f"floatRange [{low}, {high}] step {self.step}: too many steps to count")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in ("choice", "uniform", "log_uniform", "int_range", "float_range")
                    if getattr(self, name) is not None)

    def count(self) -> int | None:
        """How many values a grid search would try; None for a continuous distribution. Counted,
        never built: an intRange [0, 10^9] is one number here."""
        if self.kind == "choice":
            return len(self.choice)
        if self.kind == "int_range":
            low, high = self.int_range
            return len(range(low, high + 1, int(self.step or 1)))
        if self.kind == "float_range":
            low, high = self.float_range
            return int(math.floor((high - low) / self.step + 1e-9)) + 1
        return None

    def value_at(self, index: int) -> Any:
        """The index-th value of the grid (0 <= index < count()), without building the grid."""
        if self.kind == "choice":
            return self.choice[index]
        if self.kind == "int_range":
            return self.int_range[0] + index * int(self.step or 1)
        return round(self.float_range[0] + index * self.step, 12)

    def index_of(self, value: Any) -> int:
        """The grid index of value, or of the step nearest to it (0 for a choice not among them)."""
        if self.kind == "choice":
            return self.choice.index(value) if value in self.choice else 0
        low = getattr(self, self.kind)[0]
        index = round((value - low) / (self.step or 1))
        return min(self.count() - 1, max(0, index))

    def grid(self) -> list | None:
        """Every value, for a grid search (bounded by GRID_LIMIT before anyone builds it); None for
        a continuous distribution."""
        count = self.count()
        return None if count is None else [self.value_at(i) for i in range(count)]

    def probes(self) -> list:
        """Values that stand for everything the distribution can give: its choices, or its bounds
        and a point between them (which also shows a real number where an integer is needed)."""
        if self.kind == "choice":
            return list(self.choice)
        count = self.count()
        if count is not None:
            return sorted({self.value_at(0), self.value_at(count - 1), self.value_at(count // 2)})
        low, high = getattr(self, self.kind)
        middle = math.sqrt(low * high) if self.kind == "log_uniform" else (low + high) / 2
        return [low, middle, high]


class Objective(_Model):
    metric: Literal["loss", "validation_loss", "clip_score", "clip_directional", "accuracy", "precision", "recall",
                    "f1"] = Field(
        description="What a trial is judged by: the training loss (the mean of its last logged steps), or a "
        "validation metric (its last validation): validation_loss, accuracy, precision, recall, f1 (the "
        "classifier's, macro), clip_score, clip_directional.",
    )
    goal: Optional[Literal["minimize", "maximize"]] = Field(
        default=None, description="Unset: minimize the losses, maximize the other metrics.")

    @property
    def minimize(self) -> bool:
        return self.goal == "minimize" if self.goal else self.metric in LOWER_IS_BETTER


class EarlyStopping(_Model):
    rule: Literal["median"] = Field(
        default="median", description="median: stop a trial whose best value so far is worse than the median of "
        "the other trials' values at the same step, once at least 2 other trials have a value there.")
    min_steps: int = Field(default=1, ge=1, le=10_000_000, description="Never stop a trial before this step.")


class Pbt(_Model):
    """Population-based training: parallelTrials trials form the population; maxTrials / parallelTrials
    generations of it train stepsPerGeneration steps each, every trial continuing a checkpoint."""

    steps_per_generation: int = Field(
        ge=1, le=10_000_000, description="Steps of one generation: generation g trains to step (g+1) x this, "
        "resuming the checkpoint its line (or the trial it copied) wrote at step g x this.")
    quantile: float = Field(
        default=0.25, gt=0, le=0.5, description="The bottom share of a generation copies a trial of the top "
        "share (its checkpoint and hyperparameters, then perturbed); the rest continue their own line.")
    resample_probability: float = Field(
        default=0.25, ge=0, le=1, description="When perturbing, the chance a parameter is drawn anew instead of "
        "moved to a neighbouring value (x0.8 or x1.25, one step, or the next choice).")


# PBT changes a trial's hyperparameters between generations and resumes its checkpoint: only what a
# checkpoint does not hold may change (spec.training), and the generations set the length.
PBT_PREFIX = "training."
PBT_FIXED = {"training.maxSteps": "the generations set each trial's length (pbt.stepsPerGeneration)",
             "training.epochs": "the generations set each trial's length (pbt.stepsPerGeneration)",
             "training.optimizer": "a checkpoint's optimizer state belongs to its optimizer"}


class Template(_Model):
    spec: dict[str, Any] = Field(description="A TrainingJob spec, as in any TrainingJob.")


class TrainingSweepSpec(_Model):
    template: Template
    parameters: dict[str, Distribution] = Field(
        min_length=1, max_length=32,
        description="Spec paths of the template in the manifest's spelling (training.learningRate) -> distribution.")
    objective: Objective
    algorithm: Literal["grid", "random", "bayesian", "pbt"] = Field(
        default="random", description="grid, random, bayesian (Optuna TPE) or pbt.")
    max_trials: int = Field(ge=1, le=1000, description="Trials to run at most.")
    parallel_trials: int = Field(default=1, ge=1, le=100, description="Trials running at once.")
    early_stopping: Optional[EarlyStopping] = Field(default=None, description="Stop trials that are clearly worse.")
    pbt: Optional[Pbt] = Field(default=None, description="algorithm pbt: generation length and exploitation.")
    max_failed_fraction: float = Field(
        default=0.5, ge=0, le=1,
        description="The sweep fails when more than this share of its trials failed (a failed trial is recorded "
        "and the sweep goes on).")
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed of the search (not of the trials' training).")

    @field_validator("parameters")
    @classmethod
    def _in_path_order(cls, parameters: dict) -> dict:
        """Sorted by path: the API server stores the object with sorted keys and the draws follow this
        order, so `kubetune sweep` and the operator draw the same trials from one seed."""
        return dict(sorted(parameters.items()))

    @model_validator(mode="after")
    def _consistent(self) -> "TrainingSweepSpec":
        problems = []
        if self.max_trials < self.parallel_trials:
            problems.append(f"spec.maxTrials ({self.max_trials}) is below spec.parallelTrials "
                            f"({self.parallel_trials}): raise maxTrials or lower parallelTrials")
        if self.algorithm == "pbt":
            problems += self._pbt_problems()
        elif self.pbt is not None:
            problems.append(f"spec.pbt applies to algorithm pbt only (this sweep is {self.algorithm}): remove it")
        if self.algorithm == "grid":
            continuous = [path for path, d in self.parameters.items() if d.count() is None]
            if continuous:
                problems.append(f"spec.algorithm grid needs finite parameters; {', '.join(continuous)} "
                                "are continuous: use choice, intRange or floatRange with a step")
            elif (points := math.prod(d.count() for d in self.parameters.values())) > GRID_LIMIT:
                problems.append(f"spec.parameters: the grid has {points} points, more than {GRID_LIMIT}: "
                                "give fewer values (or a larger step), or use algorithm random")
        template = _template_spec(self.template.spec)  # raises naming spec.template.spec.<field>
        problems += _objective_problems(self.objective, template)
        for path, distribution in self.parameters.items():
            problems += _parameter_problems(path, distribution, self.template.spec)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _pbt_problems(self) -> list[str]:
        if self.pbt is None:
            return ["spec.algorithm pbt needs spec.pbt: {stepsPerGeneration: N}"]
        problems = []
        if self.parallel_trials < 2:
            problems.append("spec.parallelTrials is the population of algorithm pbt: at least 2")
        elif self.max_trials % self.parallel_trials or self.max_trials // self.parallel_trials < 2:
            problems.append(f"spec.maxTrials ({self.max_trials}) must be parallelTrials ({self.parallel_trials}) x the "
                            "number of generations (at least 2) for algorithm pbt")
        if self.early_stopping is not None:
            problems.append("spec.earlyStopping does not apply to algorithm pbt, which replaces weak trials itself: "
                            "remove it")
        if "epochs" in (self.template.spec.get("training") or {}):
            problems.append("spec.template.spec.training.epochs: algorithm pbt sets each trial's maxSteps from "
                            "spec.pbt.stepsPerGeneration: remove it")
        for path in self.parameters:
            if path in PBT_FIXED:
                problems.append(f"spec.parameters[{path}]: algorithm pbt cannot search it: {PBT_FIXED[path]}")
            elif not path.startswith(PBT_PREFIX):
                problems.append(f"spec.parameters[{path}]: algorithm pbt searches spec.training fields only (a trial "
                                "resumes another's checkpoint, which must fit its model, adapter and data)")
        return problems


# The sweep's name is a label value on each trial (kubetune.dev/sweep): at most 63 characters.
MAX_SWEEP_NAME = 63


class TrainingSweep(_Model):
    """A whole TrainingSweep manifest."""

    api_version: Literal[API_GROUP_VERSION]
    kind: Literal["TrainingSweep"]
    metadata: ObjectMeta
    spec: TrainingSweepSpec
    status: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _short_name(self) -> "TrainingSweep":
        if len(self.metadata.name) > MAX_SWEEP_NAME:
            raise ValueError(f"metadata.name is {len(self.metadata.name)} characters; a TrainingSweep's name labels "
                             f"its trials, so it is at most {MAX_SWEEP_NAME}: shorten it")
        return self


def _template_spec(spec: dict) -> TrainingJobSpec:
    try:
        return TrainingJobSpec.model_validate(spec)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"spec.template.spec.{where}: {first['msg']}") from None


def _objective_problems(objective: Objective, template: TrainingJobSpec) -> list[str]:
    family = FAMILIES[template.model.family]
    if objective.metric == TRAINING_LOSS:
        return []
    reported = VALIDATION_METRICS[objective.metric]
    if reported not in family.metrics:
        who = [name for name, f in FAMILIES.items() if reported in f.metrics]
        return [f"spec.objective.metric {objective.metric} is not reported by family {family.name} (it reports loss"
                + "".join(f", {m}" for m in _objectives_of(family.name)) + ")"
                + (f"; it is reported by {', '.join(who)}" if who else "; no family reports it yet")]
    problems = []
    if template.validation.every_steps is None:
        problems.append(f"spec.objective.metric {objective.metric} is measured at validation: set "
                        "spec.template.spec.validation.everySteps (and heldOutFraction)")
    if reported in CLIP_METRICS and template.validation.clip_model is None:
        problems.append(f"spec.objective.metric {objective.metric} is measured by a CLIP model: set "
                        "spec.template.spec.validation.clipModel")
    return problems


def _objectives_of(family: str) -> list[str]:
    return [name for name, reported in VALIDATION_METRICS.items() if reported in FAMILIES[family].metrics]


def _parameter_problems(path: str, distribution: Distribution, template: dict) -> list[str]:
    where = f"spec.parameters[{path}]"
    missing = _missing_segment(path)
    if missing:
        return [f"{where}: {missing}"]
    refused: dict[str, list] = {}  # reason -> the values refused for it
    for value in distribution.probes():
        try:
            TrainingJobSpec.model_validate(with_value(template, path, value))
        except ValidationError as err:
            for reason in sorted({e["msg"].removeprefix("Value error, ") for e in err.errors()}):
                refused.setdefault(reason, []).append(value)
    problems = []
    for reason, values in refused.items():
        hint = ""
        if "valid integer" in reason and distribution.kind in ("uniform", "log_uniform", "float_range"):
            hint = f" ({distribution.kind.replace('_u', 'U').replace('_r', 'R')} draws real numbers: use intRange or choice)"
        problems.append(f"{where}: {', '.join(repr(v) for v in values)} refused: {reason}{hint}")
    return problems


def _missing_segment(path: str) -> str | None:
    """Why PATH names no field of the TrainingJob spec (None when it does)."""
    model: type[BaseModel] | None = TrainingJobSpec
    walked = []
    for segment in path.split("."):
        if model is None:
            return f"{'.'.join(walked)} has no fields below it"
        fields = [field.alias or name for name, field in model.model_fields.items()]
        if segment not in fields:
            near = difflib.get_close_matches(segment, fields, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; it has {', '.join(sorted(fields))}"
            return f"{'.'.join(walked) or 'the spec'} has no field {segment!r}{hint}"
        walked.append(segment)
        model = model_in(field_by_alias(model, segment).annotation)
    if model is not None:
        return f"{path} is a section, not a value: name one of its fields"
    return None


def with_value(spec: dict, path: str, value: Any) -> dict:
    """A copy of SPEC (a TrainingJob spec mapping) with PATH set to VALUE, sections made as needed."""
    import copy

    result = copy.deepcopy(spec)
    *parents, last = path.split(".")
    node = result
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return result


def trial_spec(sweep: TrainingSweepSpec, parameters: dict[str, Any]) -> dict:
    """The template's spec with a trial's parameter values."""
    spec = sweep.template.spec
    for path, value in parameters.items():
        spec = with_value(spec, path, value)
    return spec


def load_sweep(path) -> TrainingSweep:
    """Read and validate the TrainingSweep in the YAML file PATH (ManifestError naming each problem)."""
    return parse_manifest(read_document(path, "TrainingSweep"), TrainingSweep)
