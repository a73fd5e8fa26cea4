"""The TrainingJob API: one typed model, free of torch and kopf.

The CRD's openAPIV3Schema is generated from these classes (`python -m kubetune_api.crd`), the
trainer parses its config with them and `kubetune validate` reports their verdict. Fields are
snake_case in Python and camelCase on the wire (Kubernetes convention); unknown fields are errors.
Every field carries a description (it becomes `kubectl explain` text) and its bounds.

Each block of the spec lives in the module of its area: spec_model (model, adapter), spec_data
(data), spec_training (training, validation, pmg, checkpoints), spec_resources (resources,
distributed, s3, tracking, scheduling, runPolicy), volumes (volumes), spec_status (the status), with
the types they share in spec_uris and spec_base. Here: the rules across blocks (a family's options,
FSDP's and CUDA's limits, monitors, resolutions, frames), TrainingJobSpec, metadata and TrainingJob.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, model_validator

from kubetune_api import families as table
from kubetune_api.contract import API_GROUP_VERSION, BACKENDS, CLIP_METRICS
from kubetune_api.families import FAMILIES, FAMILY_NAMES
from kubetune_api.rules import Rule, enforce, entries
from kubetune_api.spec_base import SpecModel
from kubetune_api.spec_data import DataSpec, frame_counts, frames_ok, resolution_ok
from kubetune_api.spec_model import AdapterSpec, ModelSpec
from kubetune_api.spec_resources import (DistributedSpec, ResourcesSpec, RunPolicySpec, S3Spec, SchedulingSpec,
                                         TrackingSpec)
from kubetune_api.spec_status import TrainingJobStatus
from kubetune_api.spec_training import CheckpointSpec, PmgSpec, TrainingSpec, ValidationSpec
from kubetune_api.volumes import MAX_VOLUMES, VOLUME_RULES, VolumeSpec


# Views of the families table (kubetune_api.families) that the rest of the code reads.
NATIVE_RESOLUTIONS: dict[str, int | None] = {name: f.native_resolution for name, f in FAMILIES.items()}
LAYOUTS_BY_FAMILY: dict[str, tuple[str, ...]] = {name: f.layouts for name, f in FAMILIES.items()}


PROCESSES_PER_GPU_MESSAGE = ("spec.distributed.processesPerNode: a GPU job runs one process per GPU; leave it "
                             "unset or equal to spec.resources.gpusPerNode")

@dataclass(frozen=True)
class FsdpConflict:
    """An option fsdp cannot shard: refused with strategy fsdp (and dropped by `kubetune plan`'s fsdp fix)."""

    uses: str                                       # CEL, self = the spec: true when the job uses it
    used_by: Callable[["TrainingJobSpec"], bool]    # the same test in Python
    message: str

    @property
    def rule(self) -> Rule:
        return Rule(f"!has(self.distributed) || self.distributed.strategy != 'fsdp' || !({self.uses})",
                    lambda spec: spec.distributed.strategy != "fsdp" or not self.used_by(spec), self.message)


FSDP_CONFLICTS = [
    FsdpConflict("has(self.model.quantization)", lambda spec: spec.model.quantization is not None,
                 "spec.model.quantization cannot be sharded by fsdp: train the quantized base with strategy ddp, "
                 "or shard the unquantized base with fsdp"),
    FsdpConflict("self.training.optimizer == 'adamw8bit'", lambda spec: spec.training.optimizer == "adamw8bit",
                 "spec.training.optimizer adamw8bit keeps quantized state that fsdp cannot shard: use adamw with "
                 "fsdp, or adamw8bit with strategy ddp"),
    FsdpConflict("self.training.mixedPrecision == 'fp16'", lambda spec: spec.training.mixed_precision == "fp16",
                 "spec.training.mixedPrecision fp16 needs a loss scaler that fsdp does not shard: use bf16 with fsdp"),
]


QUANTIZED_FULL_MESSAGE = ("spec.model.quantization freezes the base model in fp8/nf4, so only an adapter can train "
                          "on it: use spec.adapter.type lora, or drop quantization for a full fine-tune")


def fsdp_conflicts(spec: "TrainingJobSpec") -> list[str]:
    """The messages of the options in SPEC that fsdp could not shard, whatever its strategy now."""
    return [conflict.message for conflict in FSDP_CONFLICTS if conflict.used_by(spec)]


# gpusPerNode defaults to 1, so a job without it is a GPU job; has() guards what may be absent.
CPU_JOB_CEL = "has(self.resources) && has(self.resources.gpusPerNode) && self.resources.gpusPerNode == 0"


@dataclass(frozen=True)
class CudaOnlyOption:
    """An option that runs only on a CUDA GPU, refused for a job with spec.resources.gpusPerNode 0.

    One object carries the rule for both sides: `cel` for the API server and `used_by` for Python
    (kubetune validate, the webhook, the trainer), with one message. The trainer still refuses
    these options at run time when its process finds no suitable GPU (a second line).
    """

    field: str                                      # the manifest path, as the user writes it
    value: str                                      # the value that needs CUDA, as written
    used: str                                       # CEL, self = the spec: true when the job uses it
    used_by: Callable[["TrainingJobSpec"], bool]    # the same test in Python
    fix: str                                        # what to do instead on the CPU

    @property
    def message(self) -> str:
        return (f"{self.field} {self.value} needs a CUDA GPU: this job has spec.resources.gpusPerNode 0; "
                f"{self.fix} or request GPUs")

    @property
    def rule(self) -> Rule:
        return Rule(f"!({CPU_JOB_CEL}) || !({self.used})",
                    lambda spec: spec.resources.gpus_per_node != 0 or not self.used_by(spec), self.message)


CUDA_ONLY_OPTIONS = [
    CudaOnlyOption("spec.model.quantization", quant,
                   f"has(self.model.quantization) && self.model.quantization == '{quant}'",
                   lambda spec, quant=quant: spec.model.quantization == quant, "remove quantization")
    for quant in ("fp8", "nf4")
] + [
    CudaOnlyOption("spec.training.optimizer", "adamw8bit",
                   "has(self.training.optimizer) && self.training.optimizer == 'adamw8bit'",
                   lambda spec: spec.training.optimizer == "adamw8bit", "use adamw"),
    CudaOnlyOption("spec.training.mixedPrecision", "fp16",
                   "has(self.training.mixedPrecision) && self.training.mixedPrecision == 'fp16'",
                   lambda spec: spec.training.mixed_precision == "fp16", 'use bf16 (or "no")'),
    CudaOnlyOption("spec.distributed.cpuOffload", "true",
                   "has(self.distributed) && has(self.distributed.cpuOffload) && self.distributed.cpuOffload",
                   lambda spec: spec.distributed.cpu_offload,
                   "remove cpuOffload (a CPU job's weights are in CPU memory already)"),
    CudaOnlyOption("spec.training.compileMode", "reduce-overhead",
                   "has(self.training.compileMode) && self.training.compileMode == 'reduce-overhead'",
                   lambda spec: spec.training.compile_mode == "reduce-overhead",
                   "use compileMode default (CUDA graphs replay GPU work only)"),
    CudaOnlyOption("spec.model.encoderDevice", "gpu",
                   "has(self.model.encoderDevice) && self.model.encoderDevice == 'gpu'",
                   lambda spec: spec.model.encoder_device == "gpu", "use encoderDevice auto"),
    CudaOnlyOption("spec.training.attention", "flash3",
                   "has(self.training.attention) && self.training.attention == 'flash3'",
                   lambda spec: spec.training.attention == "flash3", "use attention auto or sdpa"),
]


@dataclass(frozen=True)
class FamilyOption:
    """An option whose effect depends on the family (kubetune_api.families): when a job sets it."""

    field: str                                      # the manifest path, one of kubetune_api.families.OPTIONS
    used: str                                       # CEL, self = the spec: true when the job sets it
    used_by: Callable[["TrainingJobSpec"], bool]    # the same test in Python

    def rule(self, family: str) -> Rule:
        """The rule refusing this option for FAMILY, which would ignore it."""
        honouring = table.honouring(self.field)
        return Rule(f"self.model.family != '{family}' || !({self.used})",
                    lambda spec: spec.model.family != family or not self.used_by(spec),
                    f"{table.label(self.field)} is not honoured by family {family}, which {FAMILIES[family].summary}: remove it "
                    f"(it applies to {', '.join(honouring)})")


_DEFAULT_RANK = AdapterSpec.model_fields["rank"].default

FAMILY_OPTIONS = [
    FamilyOption(table.QUANTIZATION, "has(self.model.quantization)", lambda spec: spec.model.quantization is not None),
    FamilyOption(table.VAE, "has(self.model.vae)", lambda spec: spec.model.vae is not None),
    FamilyOption(table.INIT_FROM, "has(self.adapter) && has(self.adapter.initFrom)",
                 lambda spec: spec.adapter.init_from is not None),
    FamilyOption(table.FULL_FINE_TUNE, "has(self.adapter) && has(self.adapter.type) && self.adapter.type == 'full'",
                 lambda spec: spec.adapter.type == "full"),
    FamilyOption(table.LORA_RANK, f"has(self.adapter) && has(self.adapter.rank) && self.adapter.rank != {_DEFAULT_RANK}",
                 lambda spec: spec.adapter.rank != _DEFAULT_RANK),
    FamilyOption(table.LORA_ALPHA, "has(self.adapter) && has(self.adapter.alpha)",
                 lambda spec: spec.adapter.alpha is not None),
    FamilyOption(table.LORA_DROPOUT, "has(self.adapter) && has(self.adapter.dropout) && self.adapter.dropout != 0.0",
                 lambda spec: spec.adapter.dropout != 0),
    FamilyOption(table.LORA_TARGETS, "has(self.adapter) && has(self.adapter.targetModules)",
                 lambda spec: spec.adapter.target_modules is not None),
    FamilyOption(table.BUCKETING, "has(self.data.bucketing) && self.data.bucketing",
                 lambda spec: spec.data.bucketing),
    FamilyOption(table.CAPTION_DROPOUT, "has(self.data.captionDropout) && self.data.captionDropout != 0.0",
                 lambda spec: spec.data.caption_dropout != 0),
    FamilyOption(table.CONTROL_DROPOUT, "has(self.data.controlDropout) && self.data.controlDropout != 0.0",
                 lambda spec: spec.data.control_dropout != 0),
    FamilyOption(table.EMBEDDING_CACHE, "has(self.data.cache) && has(self.data.cache.enabled) && self.data.cache.enabled",
                 lambda spec: spec.data.cache.enabled),
    FamilyOption(table.ENCODER_DEVICE, "has(self.model.encoderDevice) && self.model.encoderDevice != 'auto'",
                 lambda spec: spec.model.encoder_device != "auto"),
    FamilyOption(table.SNR_GAMMA, "has(self.training.snrGamma)", lambda spec: spec.training.snr_gamma is not None),
    FamilyOption(table.NOISE_OFFSET, "has(self.training.noiseOffset) && self.training.noiseOffset != 0.0",
                 lambda spec: spec.training.noise_offset != 0),
    FamilyOption(table.VALIDATION_PROMPTS,
                 "has(self.validation) && has(self.validation.prompts) && size(self.validation.prompts) > 0",
                 lambda spec: bool(spec.validation.prompts)),
    FamilyOption(table.GUIDANCE, "has(self.validation) && has(self.validation.guidanceScale)",
                 lambda spec: spec.validation.guidance_scale is not None),
    FamilyOption(table.CLIP_MODEL, "has(self.validation) && has(self.validation.clipModel)",
                 lambda spec: spec.validation.clip_model is not None),
    FamilyOption(table.EXPERTS, "has(self.model.experts)", lambda spec: spec.model.experts is not None),
]

def encoders_on_gpu(spec: "TrainingJobSpec") -> bool:
    """Whether a GPU job's frozen encoders (text encoders, VAE) stay on the GPU through the training
    steps (spec.model.encoderDevice). auto moves them off when the embedding cache feeds the steps.
    The one rule the trainer, `kubetune plan` and the operator's fit check read."""
    if table.ENCODER_DEVICE not in FAMILIES[spec.model.family].honours:
        return True
    choice = spec.model.encoder_device
    return choice == "gpu" or (choice == "auto" and not spec.data.cache.enabled)


ENCODERS_ON_CPU_NEED_THE_CACHE = (
    "spec.model.encoderDevice cpu needs spec.data.cache.enabled: true (without the cache every training step "
    "would run the text encoders and VAE on the CPU, minutes a step for a large model); enable the cache, or use "
    "encoderDevice auto or gpu")

# One rule per (family, option it ignores): a job never sets an option that silently does nothing.
OPTION_RULES = [option.rule(family) for option in FAMILY_OPTIONS for family in FAMILY_NAMES
                if option.field not in FAMILIES[family].honours]


def _monitor_rule(metric: str) -> Rule:
    reporting = [name for name, family in FAMILIES.items() if metric in family.metrics]
    return Rule(f"!has(self.validation) || !has(self.validation.monitor) || self.validation.monitor != '{metric}' "
                f"|| self.model.family in {reporting}",
                lambda spec: spec.validation.monitor != metric or spec.model.family in reporting,
                f"spec.validation.monitor {metric} is reported by family {' and '.join(reporting)} only; "
                "use loss for the other families")


def _clip_monitor_rule(metric: str) -> Rule:
    """A CLIP metric is measured only with a CLIP model to measure it."""
    return Rule(f"!has(self.validation) || !has(self.validation.monitor) || self.validation.monitor != '{metric}' "
                "|| has(self.validation.clipModel)",
                lambda spec: spec.validation.monitor != metric or spec.validation.clip_model is not None,
                f"spec.validation.monitor {metric} is measured by a CLIP model: set spec.validation.clipModel "
                "(a local path, an s3:// URI or a hub id such as openai/clip-vit-large-patch14), or monitor loss")


# A metric only some families report cannot be monitored by the others.
MONITOR_RULES = [_monitor_rule(metric) for metric in dict.fromkeys(m for f in FAMILIES.values() for m in f.metrics)
                 if any(metric not in family.metrics for family in FAMILIES.values())]
MONITOR_RULES += [_clip_monitor_rule(metric) for metric in CLIP_METRICS]


def _resolution_rule(family: str, multiple: int) -> Rule:
    """Each side of the training size a multiple of MULTIPLE for FAMILY (a malformed size is DATA_RULES').
    The webhook's alone: CEL cannot name the untyped resolution (rules.Rule)."""
    return Rule(None, lambda spec: spec.model.family != family or spec.data.resolution is None
                or not resolution_ok(spec.data.resolution) or all(side % multiple == 0 for side in spec.size),
                f"spec.data.resolution must be a multiple of {multiple} for family {family} (its VAE's downscale "
                "times its transformer's patch size), on each side: round it to one")


# A family whose latents are cut into patches needs a resolution those patches divide.
RESOLUTION_RULES = [_resolution_rule(name, family.resolution_multiple) for name, family in FAMILIES.items()
                    if family.resolution_multiple > 8]  # 8: spec.data.resolution's own multiple_of

LAYOUT_MESSAGE = ("spec.data.layout does not fit spec.model.family; each family reads its own layout: "
                  + ", ".join(f"{family} reads {' or '.join(layouts)}" for family, layouts in LAYOUTS_BY_FAMILY.items()))


def frames_rule(family: str, rule: table.FrameRule) -> Rule:
    """spec.data.frames in the counts FAMILY's model takes (its row's frame_rule); the refusal names
    the nearest counts that fit. The webhook's alone: CEL cannot name the untyped frames (rules.Rule)."""
    def refused(spec: "TrainingJobSpec") -> list[int]:
        frames = spec.data.frames
        if spec.model.family != family or frames is None or not frames_ok(frames):
            return []
        return [count for count in frame_counts(frames) if not rule.allows(count)]

    def nearest(spec: "TrainingJobSpec") -> str:
        return "; ".join(f"{count} is not, the nearest are {' and '.join(map(str, rule.nearest(count)))}"
                         for count in refused(spec))

    return Rule(None, lambda spec: not refused(spec),
                f"spec.data.frames must be {rule.describe()} for family {family} (the frame counts its model "
                "takes per sample)", detail=nearest)


def frame_rules(families: dict[str, table.FamilyInfo]) -> list[Rule]:
    """A video family whose model takes only some frame counts (Wan: 4k+1) refuses the others."""
    return [frames_rule(name, family.frame_rule) for name, family in families.items()
            if family.frame_rule != table.ANY_FRAMES]


FRAME_RULES = frame_rules(FAMILIES)


def _own_options_rule(block: str, family: str) -> Rule:
    """A family's own options block (its row's `options`, e.g. spec.pmg) is refused for every other family."""
    return Rule(f"!has(self.{block}) || self.model.family == '{family}'",
                lambda spec: getattr(spec, block) is None or spec.model.family == family,
                f"spec.{block} applies to family {family} only")


OWN_OPTIONS_RULES = [_own_options_rule(family.options, name) for name, family in FAMILIES.items() if family.options]


JOB_RULES = [
    *VOLUME_RULES,
    Rule(" || ".join(f"(self.model.family == '{family}' && self.data.layout in {list(layouts)})"
                     for family, layouts in LAYOUTS_BY_FAMILY.items()),
         lambda spec: spec.data.layout in LAYOUTS_BY_FAMILY[spec.model.family], LAYOUT_MESSAGE),
    *OWN_OPTIONS_RULES,
    Rule("!has(self.distributed) || !has(self.distributed.processesPerNode) || !has(self.resources) "
         "|| !has(self.resources.gpusPerNode) || self.resources.gpusPerNode == 0 "
         "|| self.distributed.processesPerNode == self.resources.gpusPerNode",
         lambda spec: (spec.distributed.processes_per_node is None or not spec.resources.gpus_per_node
                       or spec.distributed.processes_per_node == spec.resources.gpus_per_node),
         PROCESSES_PER_GPU_MESSAGE),
    Rule("!has(self.model.encoderDevice) || self.model.encoderDevice != 'cpu' "
         "|| (has(self.data.cache) && has(self.data.cache.enabled) && self.data.cache.enabled)",
         lambda spec: spec.model.encoder_device != "cpu" or spec.data.cache.enabled, ENCODERS_ON_CPU_NEED_THE_CACHE),
    Rule("!has(self.model.quantization) || !has(self.adapter) || !has(self.adapter.type) || self.adapter.type == 'lora'",
         lambda spec: spec.model.quantization is None or spec.adapter.type == "lora", QUANTIZED_FULL_MESSAGE),
    *MONITOR_RULES,
    *RESOLUTION_RULES,
    *FRAME_RULES,
    *OPTION_RULES,
    *[conflict.rule for conflict in FSDP_CONFLICTS],
    *[option.rule for option in CUDA_ONLY_OPTIONS],
]


class TrainingJobSpec(SpecModel):
    """The desired training run."""

    model_config = ConfigDict(json_schema_extra=entries(JOB_RULES))

    model: ModelSpec = Field(description="The base model.")
    adapter: AdapterSpec = Field(default_factory=AdapterSpec, description="What is trained.")
    data: DataSpec = Field(description="The training data.")
    training: TrainingSpec = Field(description="Length and optimisation.")
    checkpoints: CheckpointSpec = Field(description="Checkpoints and the final adapter.")
    validation: ValidationSpec = Field(
        default_factory=ValidationSpec, description="Held-out evaluation and sample images.",
    )
    pmg: Optional[PmgSpec] = Field(default=None, description="PMG options (family pmg only).")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Nodes, GPUs and pod sizes.")
    distributed: DistributedSpec = Field(
        default_factory=DistributedSpec, description="Data parallel (ddp) or sharded (fsdp) training.",
    )
    s3: S3Spec = Field(default_factory=S3Spec, description="S3 access for s3:// URIs.")
    volumes: list[VolumeSpec] = Field(
        default_factory=list, max_length=MAX_VOLUMES,
        description="Volumes mounted in every pod of the job (PersistentVolumeClaims, NFS, hostPath, CSI, ConfigMaps): "
        "on a cluster, a local path in the spec (model, data, cache, checkpoints) must lie under one of them.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Experiment tracking (MLflow) besides TensorBoard and Prometheus.",
    )
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Pod placement and identity.")
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec, description="Retries and time limits.")
    suspend: bool = Field(
        default=False, description="true stops the run's pods (it resumes from its latest checkpoint when false).",
    )
    image: Optional[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default=None, description="Trainer image; unset = the operator's default.",
    )
    backend: Optional[Literal[BACKENDS]] = Field(
        default=None, description="Which Kubeflow job runs the training: pytorchjob (a PyTorchJob of the Kubeflow "
        "Training Operator v1.9) or trainjob (a TrainJob of Kubeflow Trainer v2.3 with JobSet); unset = the "
        "operator's default (Helm value backend). Fixed once the job started.",
    )

    @property
    def size(self) -> tuple[int, int] | None:
        """(width, height) of the training images: spec.data.resolution, else the family's native square
        (None: the classifier's model decides)."""
        chosen = self.data.resolution
        if chosen is None:
            native = NATIVE_RESOLUTIONS[self.model.family]
            return (native, native) if native else None
        return (chosen, chosen) if isinstance(chosen, int) else (chosen[0], chosen[1])

    @property
    def resolution(self) -> int | None:
        """spec.data.resolution, else the family's native size (None: the classifier's model decides)."""
        size = self.size
        return size and round(math.sqrt(size[0] * size[1]))

    @property
    def sample_guidance(self) -> float | None:
        """The sample images' guidance: spec.validation.guidanceScale, else the family's (None: its pipeline's)."""
        chosen = self.validation.guidance_scale
        return chosen if chosen is not None else FAMILIES[self.model.family].guidance

    @property
    def save_dtype(self) -> str:
        """What the weights files are written in: spec.adapter.saveDtype, else the training precision."""
        return self.adapter.save_dtype or {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[self.training.mixed_precision]

    @property
    def pmg_options(self) -> PmgSpec:
        """spec.pmg, or its defaults where the manifest leaves it out."""
        return self.pmg or PmgSpec()

    @property
    def processes_per_node(self) -> int:
        """Trainer processes in each pod: distributed.processesPerNode, else one per GPU, else one."""
        return self.distributed.processes_per_node or max(1, self.resources.gpus_per_node)

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "TrainingJobSpec":
        return enforce(JOB_RULES, self, info)


_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ANNOTATIONS_MAX_BYTES = 256 * 1024  # Kubernetes' limit on all of an object's annotations together


def check_metadata_key(key: str) -> str:
    """A label or annotation key as Kubernetes accepts it: [prefix/]name."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise ValueError(f"key {key!r}: its prefix must be a DNS subdomain of at most 253 characters")
    if len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
        raise ValueError(f"key {key!r}: the name must be 1-63 characters [A-Za-z0-9._-], starting and "
                         "ending alphanumeric")
    return key


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        check_metadata_key(key)
        if len(value) > 63 or (value and not _QUALIFIED_NAME.fullmatch(value)):
            raise ValueError(f"label {key}: value {value[:70]!r} must be at most 63 characters [A-Za-z0-9._-], "
                             "starting and ending alphanumeric")
    return labels


def check_annotations(annotations: dict[str, str]) -> dict[str, str]:
    for key in annotations:
        check_metadata_key(key)
    size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        raise ValueError(f"annotations hold {size} bytes; Kubernetes allows {ANNOTATIONS_MAX_BYTES} in all")
    return annotations


class ObjectMeta(SpecModel):
    """Kubernetes object metadata, as the API server would accept it (fields it sets itself are
    allowed, so `kubectl get -o yaml` output reads back; anything else is refused, e.g. `namspace`)."""

    name: str = Field(
        min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN.pattern,
        description="DNS-1123 name of the job.",
    )
    namespace: Optional[str] = Field(
        default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="DNS-1123 label: the namespace (it also names the run's directory).",
    )
    labels: Annotated[dict[str, str], AfterValidator(check_labels)] = Field(default_factory=dict)
    annotations: Annotated[dict[str, str], AfterValidator(check_annotations)] = Field(default_factory=dict)
    # Set by the API server; read back from `kubectl get -o yaml`, never used.
    uid: Optional[str] = None
    resource_version: Optional[str] = None
    generation: Optional[int] = None
    creation_timestamp: Optional[str] = None
    deletion_timestamp: Optional[str] = None
    deletion_grace_period_seconds: Optional[int] = None
    generate_name: Optional[str] = None
    finalizers: Optional[list[str]] = None
    owner_references: Optional[list[dict[str, Any]]] = None
    managed_fields: Optional[list[dict[str, Any]]] = None
    self_link: Optional[str] = None


class TrainingJob(SpecModel):
    """A whole TrainingJob manifest, as written to `kubectl apply`."""

    api_version: Literal[API_GROUP_VERSION] = Field(description=API_GROUP_VERSION)
    kind: Literal["TrainingJob"] = Field(description="TrainingJob")
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: Optional[TrainingJobStatus] = Field(default=None, description="Written by the operator.")
