"""The TrainingJob API: one typed model, free of torch and kopf.

The CRD's openAPIV3Schema is generated from these classes (`python -m kubetune_api.crd`), the
trainer parses its config with them and `kubetune validate` reports their verdict. Fields are
snake_case in Python and camelCase on the wire (Kubernetes convention); unknown fields are errors.
Every field carries a description (it becomes `kubectl explain` text) and its bounds.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Optional, Union, get_args

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kubetune_api.contract import API_GROUP, API_GROUP_VERSION, API_VERSION, BACKENDS, CLIP_METRICS, KIND  # noqa: F401  (the contract names the API)
from kubetune_api.contract import RECENT_LOSS_STEPS
from kubetune_api import families as table
from kubetune_api.families import FAMILIES, FAMILY_NAMES
from kubetune_api.hub import HUB_ID, looks_like_hub_id
from kubetune_api.rules import Rule, enforce, entries
from kubetune_api.spec_base import SpecModel
from kubetune_api.volumes import MAX_VOLUMES, VOLUME_RULES, VolumeSpec

# URI schemes the storage layer understands; a bare path (no scheme) is a local path.
SUPPORTED_URI_SCHEMES = ("s3",)


_Model = SpecModel  # the base of every block (kubetune_api.spec_base)


_SCHEME_WITHOUT_SLASHES = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(?!//)")
# S3's bucket naming rules (the virtual-host-safe form every S3 implementation accepts).
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# Characters a user writes meaning something else than a key character (a URL query, a fragment,
# a Windows path, a percent-escape), or that no tool shows faithfully.
_KEY_CHARACTERS_REFUSED = set("?#\\%")


def check_storage_uri(value: str) -> str:
    """Accept a local path or s3://bucket[/prefix]; name the supported forms otherwise."""
    if "://" not in value:
        if _SCHEME_WITHOUT_SLASHES.match(value):  # s3:/bucket/x would silently be a local directory
            scheme = value.split(":", 1)[0]
            raise ValueError(f"{value!r} looks like a {scheme}: URI without its two slashes; write "
                             f"{scheme}://bucket/prefix, or ./{value} for a local path")
        return value
    scheme, rest = value.split("://", 1)
    if scheme not in SUPPORTED_URI_SCHEMES:
        raise ValueError(
            f"unsupported URI scheme {scheme!r}; use a local path or s3://bucket/prefix"
        )
    if not rest or rest.startswith("/"):
        raise ValueError("an s3 URI needs a bucket: s3://bucket/prefix")
    bucket, _, prefix = rest.partition("/")
    if not _S3_BUCKET.fullmatch(bucket):
        raise ValueError(f"{bucket!r} is not an S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens, "
                         "starting and ending with a letter or digit")
    odd = sorted({c for c in prefix if c in _KEY_CHARACTERS_REFUSED or not c.isprintable()})
    if odd:
        raise ValueError(f"the key prefix {prefix!r} contains {', '.join(repr(c) for c in odd)}; S3 would take "
                         "them literally (no query, fragment or escape): use letters, digits and / - _ . only")
    segments = prefix.rstrip("/").split("/") if prefix else []
    if any(segment in ("", ".", "..") for segment in segments):
        raise ValueError(f"the key prefix {prefix!r} has an empty, '.' or '..' segment; S3 keeps them as written, "
                         "so the same run would have two names (and '..' climbs out locally): write s3://bucket/a/b")
    return value


# The same rule for the API server, in CEL (check_storage_uri is the Python side, which also
# refuses control characters).
_STORAGE_URI_RULE = ("self.contains('://') ? (self.matches('^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/|$)') && "
                     "!self.matches('^s3://[^/]+/(.*/)?\\\\.{1,2}(/|$)') && !self.matches('^s3://.*//') && "
                     "!self.matches('[?#%\\\\\\\\]')) "
                     ": !self.matches('^[A-Za-z][A-Za-z0-9+.-]*:')")
_STORAGE_URI_FORMS = "two slashes, an S3 bucket name, no '.', '..' or empty key segments, no ? # % or backslash"

StorageUri = Annotated[str, AfterValidator(check_storage_uri), Field(
    min_length=1, max_length=2048,
    json_schema_extra={"x-kubernetes-validations": [{
        "rule": _STORAGE_URI_RULE,
        "message": f"unsupported URI; use a local path or s3://bucket/prefix ({_STORAGE_URI_FORMS})",
    }]},
)]


def check_resume_source(value: str) -> str:
    if value != "latest":
        try:
            check_storage_uri(value)
        except ValueError as err:
            raise ValueError(f"use latest or a checkpoint URI (s3://bucket/prefix/ns/job/v0/checkpoint-500): {err}")
    return value


ResumeSource = Annotated[str, AfterValidator(check_resume_source), Field(
    min_length=1, max_length=2048,
    json_schema_extra={"x-kubernetes-validations": [{
        "rule": f"self == 'latest' || ({_STORAGE_URI_RULE})",
        "message": "use latest or a checkpoint URI (a local path or s3://bucket/prefix/ns/job/v0/checkpoint-500; "
                   f"{_STORAGE_URI_FORMS})",
    }]},
)]


Family = Literal[FAMILY_NAMES]
Layout = Literal["captions", "edit-pairs", "pmg", "image-folder", "video-captions"]
# The layouts whose samples are video clips: they take spec.data.frames (needed) and fps.
VIDEO_LAYOUTS = ("video-captions",)
# The layouts that read metadata.jsonl, whose keys spec.data.imageColumn and captionColumn name.
METADATA_LAYOUTS = ("captions", "video-captions")

# Views of the families table (kubetune_api.families) that the rest of the code reads.
NATIVE_RESOLUTIONS: dict[str, int | None] = {name: f.native_resolution for name, f in FAMILIES.items()}
LAYOUTS_BY_FAMILY: dict[str, tuple[str, ...]] = {name: f.layouts for name, f in FAMILIES.items()}


MODEL_RULES = [
    Rule(f"!has(self.revision) || self.pretrained.matches('^{HUB_ID.pattern}$')",
         lambda model: model.revision is None or looks_like_hub_id(model.pretrained),
         "spec.model.revision names a tag, branch or commit of a hub model: make spec.model.pretrained a hub id "
         "(org/name), or remove the revision"),
]


class ModelSpec(_Model):
    """Which model family to train and where its pretrained weights are."""

    model_config = ConfigDict(json_schema_extra=entries(MODEL_RULES))

    family: Family = Field(
        description="Model family: " + ", ".join(FAMILY_NAMES) + "."
    )
    pretrained: StorageUri = Field(
        description="Pretrained weights: a local path, an s3:// URI, or a model-hub id "
        "(e.g. org/name), in the family's standard (diffusers/transformers) folder layout."
    )

    quantization: Optional[Literal["fp8", "nf4"]] = Field(
        default=None,
        description="Load the frozen base weights quantized to save GPU memory: fp8 (a CUDA GPU of "
        "compute capability 8.9+) or nf4 (a CUDA GPU with bitsandbytes). Unset = the training precision.",
    )
    vae: Optional[StorageUri] = Field(
        default=None,
        description="A VAE to encode and decode with instead of the model's own: a local path, an s3:// URI or a "
        "hub id of a VAE folder (or of a model folder holding vae/), e.g. SDXL's fp16-fix VAE. Its latent "
        "channels must be the model's own VAE's. Unset: <pretrained>/vae.",
    )
    encoder_device: Literal["auto", "gpu", "cpu"] = Field(
        default="auto",
        description="Where the frozen text encoders and VAE live during training on a GPU: auto (on the CPU when "
        "spec.data.cache is enabled, since training steps then read their outputs from the cache, else on the "
        "GPU); gpu; cpu (needs the cache). They come to the GPU for filling the cache and for validation "
        "samples, and leave it after.",
    )
    experts: Optional[Literal["high-noise", "low-noise", "both"]] = Field(
        default=None,
        description="A two-expert model (Wan 2.2 A14B: transformer for high noise, transformer_2 for low noise, "
        "split at its boundary_ratio): which expert trains, on the noise levels it denoises: high-noise, "
        "low-noise, or both (each sample goes to the expert of its noise level). Unset: every expert the model "
        "has. A one-expert model refuses it.",
    )
    revision: Optional[str] = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="For a model-hub id in pretrained: the tag, branch or commit to train from (unset: main). A "
        "branch is resolved to its commit at the run's first start and recorded in the run, so every node and every "
        "restart reads the same files.",
    )
    hub_token_secret: Optional[str] = Field(
        default=None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A Secret in the job's namespace whose key HF_TOKEN is the model hub's access token, for gated "
        "or private hub models (pretrained, vae, spec.validation.clipModel). It reaches only the process that "
        "downloads, as a secretKeyRef: never the ConfigMap, an argument, a log or the status.",
    )
    mirror_uri: Optional[StorageUri] = Field(
        default=None,
        description="An s3:// prefix where hub models are mirrored: the first pod that needs a (model, commit) "
        "downloads it once from the hub into <mirrorUri>/hub/<org>/<name>/<commit>/, every other pod, job and "
        "restart reads it from there. Unset: the operator's models.mirrorUri; unset there too, each pod downloads.",
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": f"self.startsWith('s3://') && ({_STORAGE_URI_RULE})",
            "message": f"mirrorUri is an s3:// prefix: s3://bucket/prefix ({_STORAGE_URI_FORMS})"}]},
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "ModelSpec":
        return enforce(MODEL_RULES, self, info)

    @field_validator("mirror_uri")
    @classmethod
    def _mirror_on_s3(cls, value: Optional[str]) -> Optional[str]:
        # Every pod of every job must reach the mirror: a local path is one node's disk.
        if value is not None and not value.startswith("s3://"):
            raise ValueError("mirrorUri is an s3:// prefix (s3://bucket/prefix): every pod must reach it")
        return value



class AdapterSpec(_Model):
    """What is trained: a LoRA adapter on the base model, or all of its weights."""

    type: Literal["lora", "full"] = Field(
        default="lora", description="lora trains a low-rank adapter; full trains every weight."
    )
    rank: int = Field(default=8, ge=1, le=1024, description="LoRA rank r (1-1024).")
    alpha: Optional[float] = Field(
        default=None, gt=0, le=4096,
        description="LoRA alpha; the update is scaled by alpha/rank. Defaults to the rank.",
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input (0-1).")
    target_modules: Optional[list[Annotated[str, Field(min_length=1, max_length=253)]]] = Field(
        default=None, max_length=64,
        description="Module names that get LoRA layers; defaults to the family's attention projections.",
    )
    init_from: Optional[StorageUri] = Field(
        default=None,
        description="Start the LoRA from existing weights: a directory holding "
        "pytorch_lora_weights.safetensors, or the file. Its rank and target modules must match.",
    )
    save_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        default=None,
        description="Precision of the weights files written (final and per checkpoint): fp32, bf16 or fp16. "
        "Unset = the training precision (spec.training.mixedPrecision; fp32 for \"no\"). Training and "
        "resuming always keep fp32 weights.",
    )



class CacheSpec(_Model):
    """Precomputed encoder outputs, keyed by each sample's content and the encoder's identity."""

    enabled: bool = Field(
        default=False,
        description="Encode each image and caption once and reuse the result in later steps, epochs and runs. "
        "Augmentation stays cacheable: each image is stored with its mirror (randomFlip) and each caption with "
        "its dropped form, and a random crop is chosen once per image instead of per epoch.",
    )
    uri: Optional[StorageUri] = Field(
        default=None,
        description="Where the cache lives (local path or s3://); shared by all processes and runs. "
        "Unset = <spec.checkpoints.uri>/cache.",
    )



# Kubernetes resource quantities such as 500m, 4, 16Gi, 1.5G.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]


class StreamingSpec(_Model):
    """How an s3:// data set is read: streamed as training goes, or copied whole first."""

    enabled: bool = Field(
        default=True,
        description="s3:// data only: fetch each process's images just ahead of training them (the first step "
        "starts after one listing, and the disk holds about cacheSize of the data set). false copies the whole "
        "data set to the pod's disk before the first step (and checks every image first, honouring skipBad).",
    )
    cache_size: Quantity = Field(
        default="4Gi",
        description="Bytes of streamed images each process keeps on its node's disk ahead of training, e.g. 4Gi.",
    )
    prefetch_steps: int = Field(
        default=8, ge=1, le=10_000, description="Optimizer steps of images fetched ahead of the loader.",
    )


# One int (a square) or [width, height]. The CRD cannot type a number-or-list field (a structural
# schema has one type per field): the API server keeps it as given, and the admission webhook (and
# kubetune validate) check its form with DATA_RULES, whose rules on it have no CEL form.
Resolution = Union[int, list[int]]


def _resolution_ok(value: int | list[int]) -> bool:
    sides = [value] if isinstance(value, int) else value
    return (isinstance(value, int) or len(value) == 2) and all(8 <= side <= 4096 and side % 8 == 0 for side in sides)


# One count, or several (frame-count buckets: each clip trains at the longest it holds). Untyped in
# the CRD as spec.data.resolution is, for the same reason: its rules are the webhook's alone.
Frames = Union[int, list[int]]
MAX_FRAMES = 1024


def frame_counts(frames: Frames | None) -> list[int]:
    """spec.data.frames as a list of counts (none when unset)."""
    return [] if frames is None else [frames] if isinstance(frames, int) else list(frames)


def _frames_ok(value: Frames) -> bool:
    counts = frame_counts(value)
    return (isinstance(value, int) or 1 <= len(value) <= 16 and len(set(value)) == len(value)) \
        and all(1 <= count <= MAX_FRAMES for count in counts)


@dataclass(frozen=True)
class DataFormat:
    """How one spec.data.format stores samples: the layouts it can hold, and the names its columns go by
    when the spec names none (the Hugging Face conventions of each)."""

    layouts: tuple[str, ...]
    image_column: str | None    # None: a WebDataset sample's image member, whatever its extension
    caption_column: str
    label_column: str | None    # None: labels are not in columns (files: the class folders)
    control_column: str | None  # edit-pairs: where the control images are (None: control_images/)
    description: str
    video_column: str | None = None  # the video layouts' image column (None: a WebDataset clip member)


DATA_FORMATS: dict[str, DataFormat] = {
    "files": DataFormat(get_args(Layout), "file_name", "text", None, None,  # every layout's own loose files
                        "loose files as the layout describes them", video_column="file_name"),
    "parquet": DataFormat(("captions", "image-folder", "edit-pairs", "video-captions"), "image", "text", "label",
                          "control_image",
                          "*.parquet files as Hugging Face datasets saves them: an image column of {bytes, path} "
                          "structs, bytes, or paths relative to the data folder, and a caption (or label) column; "
                          "edit pairs add a control image column (one image or a list of them); video-captions "
                          "reads clips from a video column alike",
                          video_column="video"),
    "webdataset": DataFormat(("captions", "image-folder", "edit-pairs", "video-captions"), None, "text", "label",
                             "control",
                             "WebDataset *.tar shards: each sample is the members sharing a KEY, KEY.jpg/png/webp "
                             "with KEY.txt (or KEY.json's caption column) or KEY.cls (or KEY.json's label column); "
                             "edit pairs add KEY.control.png (or KEY.control_0.png, KEY.control_1.png, ...); "
                             "video-captions: KEY.mp4/webm/mov with KEY.txt"),
}
DataFormatName = Literal[tuple(DATA_FORMATS)]


def data_columns(data: "DataSpec") -> tuple[str | None, str, str | None, str | None]:
    """(image, caption, label, control) column names of the data: the spec's, else its format's defaults."""
    row = DATA_FORMATS[data.format]
    media = row.video_column if data.layout in VIDEO_LAYOUTS else row.image_column
    return (data.image_column or media, data.caption_column or row.caption_column,
            data.label_column or row.label_column, data.control_column or row.control_column)


DATA_RULES = [
    Rule(None,  # the CRD leaves the number-or-list untyped: CEL cannot name it (rules.Rule)
         lambda data: data.resolution is None or _resolution_ok(data.resolution),
         "spec.data.resolution: give one side for a square (512, 1024) or [width, height] (e.g. [832, 576]), "
         "each 8 to 4096 pixels in multiples of 8"),
    Rule(" || ".join(f"(self.format == '{name}' && self.layout in {list(row.layouts)})"
                     for name, row in DATA_FORMATS.items()),
         lambda data: data.layout in DATA_FORMATS[data.format].layouts,
         "spec.data.format does not fit spec.data.layout: "
         + "; ".join(f"{name} stores {', '.join(row.layouts)}" for name, row in DATA_FORMATS.items())
         + " (use format files, loose files, for the others)"),
    Rule(f"!has(self.captionColumn) || self.layout in {list(METADATA_LAYOUTS)} || (self.layout == 'edit-pairs' "
         "&& self.format != 'files')",
         lambda data: data.caption_column is None or data.layout in METADATA_LAYOUTS
         or (data.layout == "edit-pairs" and data.format != "files"),
         "spec.data.captionColumn names the captions of the captions and video-captions layouts, or the "
         "instructions of edit pairs stored as parquet or webdataset: remove it for this layout"),
    Rule("!has(self.controlColumn) || (self.layout == 'edit-pairs' && self.format != 'files')",
         lambda data: data.control_column is None or (data.layout == "edit-pairs" and data.format != "files"),
         "spec.data.controlColumn names the control images of edit pairs stored as parquet or webdataset: "
         "remove it (loose edit pairs keep them in control_images/)"),
    Rule(f"!has(self.imageColumn) || self.layout in {list(METADATA_LAYOUTS)} || self.format != 'files'",
         lambda data: data.image_column is None or data.layout in METADATA_LAYOUTS or data.format != "files",
         "spec.data.imageColumn names metadata.jsonl's image (clip) key in the captions and video-captions layouts, "
         "or the image column of format parquet or webdataset: remove it for this layout's loose files"),
    Rule("!has(self.labelColumn) || (self.layout == 'image-folder' && self.format != 'files')",
         lambda data: data.label_column is None or (data.layout == "image-folder" and data.format != "files"),
         "spec.data.labelColumn names the label column of the image-folder layout stored as format parquet or "
         "webdataset: remove it (loose image-folder files are labelled by their class folders)"),
    Rule(None,  # untyped number-or-list (rules.Rule)
         lambda data: data.frames is None or _frames_ok(data.frames),
         f"spec.data.frames: give the frames per sample (81) or a list of up to 16 different counts (frame-count "
         f"buckets, e.g. [33, 81]), each 1 to {MAX_FRAMES}"),
    Rule(None,  # untyped number-or-list (rules.Rule)
         lambda data: (data.frames is not None) == (data.layout in VIDEO_LAYOUTS),
         f"spec.data.frames (frames per sample) is needed by the {' and '.join(VIDEO_LAYOUTS)} layout and "
         "applies to it only: set it for video clips, remove it for images"),
    Rule(f"!has(self.fps) || self.layout in {list(VIDEO_LAYOUTS)}",
         lambda data: data.fps is None or data.layout in VIDEO_LAYOUTS,
         f"spec.data.fps resamples video clips: it applies to the {' and '.join(VIDEO_LAYOUTS)} layout only; "
         "remove it for images"),
]


class DataSpec(_Model):
    """Where the training data is and how it is laid out."""

    model_config = ConfigDict(json_schema_extra=entries(DATA_RULES))

    layout: Layout = Field(
        description="captions: images + metadata.jsonl (or metadata.csv) of {file_name, text}, or without "
        "either each image NAME.png with its caption in NAME.txt; edit-pairs: "
        "control_images/NAME.png (or NAME_0.png, NAME_1.png, ... for several reference images) + "
        "training_images/NAME.png with NAME.txt prompts; pmg: data.json of user histories; "
        "image-folder: CLASS/NAME.png; video-captions: video clips (.mp4, .webm, .mov) + metadata.jsonl of "
        "{file_name, text}, or each clip NAME.mp4 with NAME.txt."
    )
    uri: StorageUri = Field(description="The data directory: a local path or s3://bucket/prefix.")
    format: DataFormatName = Field(
        default="files",
        description="How the samples are stored: "
        + "; ".join(f"{name}: {row.description}" for name, row in DATA_FORMATS.items())
        + ". Read from a local path or streamed from s3:// alike; parquet and webdataset hold "
        + " and ".join(DATA_FORMATS["parquet"].layouts) + " data.",
    )
    image_column: Optional[str] = Field(
        default=None, min_length=1, max_length=253,
        description="Where each sample's image is: files (captions and video-captions layouts): the metadata.jsonl "
        "key naming its file (clip), relative to metadata.jsonl's folder or its images/ (videos/) subfolder "
        "(unset: file_name); parquet: the image "
        "column (unset: image; video-captions: video); webdataset: the image member's extension, e.g. jpg (unset: "
        "any of jpg, jpeg, png, webp; video-captions: mp4, webm, mov).",
    )
    caption_column: Optional[str] = Field(
        default=None, min_length=1, max_length=253,
        description="captions and video-captions layouts (and edit-pairs as parquet or webdataset: the "
        "instruction): the "
        "metadata.jsonl key (files) or column (parquet) holding each caption, or the field of KEY.json when a "
        "WebDataset sample has no KEY.txt (unset: text).",
    )
    control_column: Optional[str] = Field(
        default=None, min_length=1, max_length=253,
        description="edit-pairs layout as parquet: the column of each sample's control image, or of a list of "
        "them in order (unset: control_image); as webdataset: the member name before the image extension, "
        "KEY.control.png or KEY.control_0.png, KEY.control_1.png, ... (unset: control).",
    )
    label_column: Optional[str] = Field(
        default=None, min_length=1, max_length=253,
        description="image-folder layout as parquet: the label column (unset: label; class names from the "
        "dataset's ClassLabel feature when it has one); as webdataset: the field of KEY.json when a sample has "
        "no KEY.cls (unset: label). Labels that are names are numbered in sorted order, as class folders are.",
    )
    resolution: Optional[Resolution] = Field(
        default=None,
        description="Training size in pixels: a number for a square (512, 1024) or [width, height] (e.g. [832, "
        "576]), each side a multiple of 8 from 8 to 4096 (the DiT families: of 16). Unset: the family's native "
        "size (docs/families.md; the classifier: its model's image size).",
    )
    frames: Optional[Frames] = Field(
        default=None,
        description="video-captions layout (needed there, refused elsewhere): frames per sample, e.g. 81, in the "
        "counts the family's model takes (docs/families.md; Wan: 4k+1). A list (e.g. [33, 81]) makes frame-count "
        "buckets: each clip trains at the longest count it holds, batched with clips of that count. A clip "
        "shorter than the shortest count (at fps) is refused or skipped (skipBad). Where a sample starts in its "
        "clip is drawn per epoch from the seed (once per clip with the embedding cache).",
    )
    fps: Optional[float] = Field(
        default=None, gt=0, le=240,
        description="video-captions layout: the frame rate samples are taken at; each clip is resampled to it "
        "(the source frame nearest each sample time, its average rate assumed constant). Unset: each clip's own "
        "frames, whatever its rate.",
    )
    center_crop: bool = Field(default=True, description="Center-crop to the resolution (else random crop).")
    random_flip: bool = Field(default=False, description="Randomly flip images horizontally.")
    caption_dropout: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Probability of training a sample with an empty caption (0-1).",
    )
    control_dropout: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="edit-pairs only: probability of training a sample with blank control images (all of "
        "its references at once; 0-1).",
    )
    bucketing: bool = Field(
        default=False,
        description="Aspect-ratio bucketing: resize each image to the bucket (about resolution x resolution "
        "pixels) nearest its aspect ratio, and batch only images of one bucket, instead of square crops.",
    )
    num_workers: int = Field(default=0, ge=0, le=64, description="Data-loading worker processes per rank.")
    skip_bad: bool = Field(
        default=False,
        description="Skip samples that cannot be used (an unreadable, truncated or oversized image, a caption "
        "that is not UTF-8 text, a broken metadata record), counting them in the log and the "
        "kubetune_trainer_samples_skipped metric; by default the job is refused before training, naming the file.",
    )
    cache: CacheSpec = Field(
        default_factory=CacheSpec, description="Cache of VAE latents and text embeddings.",
    )
    streaming: StreamingSpec = Field(
        default_factory=StreamingSpec, description="How an s3:// data set is read (streamed by default).",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "DataSpec":
        return enforce(DATA_RULES, self, info)



TRAINING_RULES = [
    Rule("has(self.maxSteps) != has(self.epochs)",
         lambda training: (training.max_steps is None) != (training.epochs is None),
         "set exactly one of spec.training.maxSteps or spec.training.epochs, not both"),
    Rule("self.optimizer != 'schedulefree-adamw' || self.lrScheduler == 'constant'",
         lambda training: training.optimizer != "schedulefree-adamw" or training.lr_scheduler == "constant",
         "spec.training.optimizer schedulefree-adamw replaces the schedule: set spec.training.lrScheduler to "
         "constant (lrWarmupSteps still applies)"),
    Rule("self.compileMode == 'default' || self.compile",
         lambda training: training.compile_mode == "default" or training.compile,
         "spec.training.compileMode applies with spec.training.compile: true; set compile: true or remove compileMode"),
]


class TrainingSpec(_Model):
    """How long and how to optimise. Give maxSteps or epochs."""

    model_config = ConfigDict(json_schema_extra=entries(TRAINING_RULES))

    max_steps: Optional[int] = Field(
        default=None, ge=1, le=10_000_000, description="Optimizer steps to train for."
    )
    epochs: Optional[int] = Field(
        default=None, ge=1, le=100_000, description="Passes over the data (instead of maxSteps)."
    )
    batch_size: int = Field(default=1, ge=1, le=4096, description="Samples per process per micro-batch.")
    gradient_accumulation_steps: int = Field(
        default=1, ge=1, le=1024, description="Micro-batches accumulated per optimizer step."
    )
    learning_rate: float = Field(default=1e-4, gt=0, le=1, description="Peak learning rate (> 0).")
    lr_scheduler: Literal["constant", "linear", "cosine", "cosine-restarts", "step", "plateau"] = Field(
        default="constant",
        description="Learning-rate schedule after warmup: constant; linear or cosine decay; cosine-restarts "
        "(lrCycles cosine cycles); step (times lrGamma every lrStepSize steps); plateau (times lrGamma "
        "after lrPlateauPatience steps without a lower loss).",
    )
    lr_cycles: int = Field(default=1, ge=1, le=1000, description="cosine-restarts: number of cosine cycles.")
    lr_step_size: int = Field(default=1000, ge=1, le=10_000_000, description="step: optimizer steps between decays.")
    lr_gamma: float = Field(default=0.1, gt=0, le=1, description="step and plateau: factor applied at each decay.")
    lr_plateau_patience: int = Field(
        default=10, ge=1, le=1_000_000,
        description="plateau: losses (validation loss when validation runs, else training loss) without "
        "improvement before a decay.",
    )
    lr_warmup_steps: int = Field(
        default=0, ge=0, le=10_000_000, description="Optimizer steps of linear warmup from 0."
    )
    optimizer: Literal["adamw", "adamw8bit", "prodigy", "lion", "sgd", "schedulefree-adamw"] = Field(
        default="adamw",
        description="Optimizer: adamw; adamw8bit (CUDA + bitsandbytes); prodigy (learning-rate free: use "
        "learningRate 1.0); lion (use a 3-10x smaller learning rate); sgd (with sgdMomentum); "
        "schedulefree-adamw (needs no schedule: lrScheduler must be constant).",
    )
    sgd_momentum: float = Field(default=0.9, ge=0, lt=1, description="sgd: momentum.")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(default=1e-8, gt=0, le=1, description="AdamW epsilon.")
    weight_decay: float = Field(default=1e-2, ge=0, le=1, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(
        default=1.0, ge=0, le=1e6, description="Clip gradients to this global norm; 0 disables clipping."
    )
    max_grad_value: Optional[float] = Field(
        default=None, gt=0, le=1e6,
        description="Clip every gradient element to [-maxGradValue, maxGradValue] (before the norm clipping); "
        "unset = no clipping by value.",
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        default="no", description='Mixed precision: "no" (fp32), fp16 (GPU only) or bf16.'
    )
    seed: int = Field(default=42, ge=0, le=2**32 - 1, description="Seed for weights init, data order and noise.")
    snr_gamma: Optional[float] = Field(
        default=None, gt=0, le=100,
        description="Min-SNR loss weighting gamma (5.0 is the usual value); unset = plain MSE.",
    )
    noise_offset: float = Field(default=0.0, ge=0, le=1, description="Offset noise strength (0 disables).")
    log_every_steps: int = Field(default=1, ge=1, le=100_000, description="Log loss and lr every N steps.")
    ema_decay: Optional[float] = Field(
        default=None, gt=0, lt=1,
        description="Keep an exponential moving average of the trained weights with this decay (e.g. 0.999); "
        "the saved weights are the average. Unset = no EMA.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass: less memory, about 30% slower.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile the trained model's repeated blocks (regional compilation: each block class is "
        "compiled once and reused; the log states the compile time). The first step is slow; every bucket "
        "shape compiles once.",
    )
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = Field(
        default="default",
        description="With compile: default; max-autotune-no-cudagraphs (longer compile, faster kernels); "
        "reduce-overhead (CUDA graphs: least launch overhead, a GPU only).",
    )
    attention: Literal["auto", "sdpa", "flash3"] = Field(
        default="auto",
        description="Attention kernel on a GPU: auto (FlashAttention 3 on a Hopper GPU whose image has its "
        "kernels, else PyTorch SDPA's flash / memory-efficient kernels); sdpa; flash3 (refused where absent). "
        "The log states the choice.",
    )
    debug_overfit_batch: bool = Field(
        default=False,
        description="Debug mode: train on the first batch only, again and again; the loss should go to ~0.",
    )
    profile_steps: Optional[int] = Field(
        default=None, ge=1, le=1000,
        description="Record a torch profiler trace of this many steps (after 1 warm-up step) into "
        "<spec.checkpoints.uri>/profile, readable by TensorBoard and Perfetto.",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "TrainingSpec":
        return enforce(TRAINING_RULES, self, info)


class ValidationSpec(_Model):
    """Held-out evaluation and sample images during training."""

    every_steps: Optional[int] = Field(
        default=None, ge=1, le=10_000_000,
        description="Validate every N optimizer steps and at the end; unset = no validation.",
    )
    held_out_fraction: float = Field(
        default=0.0, ge=0.0, le=0.5,
        description="Fraction of the data (chosen by file-name hash, stable across runs) kept out of "
        "training for the held-out loss and metrics (0-0.5).",
    )
    prompts: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(
        default_factory=list, max_length=16,
        description="Text-to-image families: prompts sampled as images at each validation. Edit families "
        "sample the first held-out (else training) pairs instead.",
    )
    num_samples: int = Field(
        default=2, ge=0, le=16, description="Held-out samples drawn as images at each validation: by edit "
        "families always, by text-to-image families (their captions) when clipModel is set and prompts are "
        "not (0 = none).",
    )
    num_inference_steps: int = Field(default=20, ge=1, le=1000, description="Denoising steps of sample images.")
    guidance_scale: Optional[float] = Field(
        default=None, ge=0, le=100,
        description="Guidance of the sample images: the classifier-free guidance scale, or the distilled guidance "
        "of the FLUX families. Unset: the family's default (docs/families.md).",
    )
    clip_model: Optional[StorageUri] = Field(
        default=None,
        description="A CLIP model that scores the images sampled at each validation (same seed every time): "
        "a local path, an s3:// URI or a hub id (e.g. openai/clip-vit-large-patch14) in the transformers "
        "layout. Text-to-image families report clip_score, 100 x the mean cosine of image "
        "and prompt; edit families report clip_directional, the cosine of the edit's image direction and its "
        "instruction's text direction.",
    )
    monitor: Literal["loss", "accuracy", "precision", "recall", "f1", "clip_score", "clip_directional"] = Field(
        default="loss",
        description="Metric for early stopping and keepBest: held-out loss (lower is better), the "
        "classifier's accuracy or macro precision, recall or F1, or clip_score / clip_directional with "
        "clipModel (higher is better).",
    )
    early_stopping_patience: Optional[int] = Field(
        default=None, ge=1, le=100_000,
        description="Stop after this many validations without improvement of the monitored metric.",
    )
    keep_best: Optional[int] = Field(
        default=None, ge=1, le=100,
        description="Keep the weights of the K best validations by the monitored metric under "
        "<spec.checkpoints.uri>/best/.",
    )


# A file under spec.data.uri: relative, each segment starting with a letter, digit, _ or - (so no
# '.', '..' or hidden names); the pattern is the whole rule, for the API server and Python alike.
DataFileName = Annotated[str, Field(
    min_length=1, max_length=1024, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*$",
)]

PMG_RULES = [
    Rule("!has(self.prefixHiddenSize) || (has(self.prefixProjection) && self.prefixProjection)",
         lambda pmg: pmg.prefix_hidden_size is None or pmg.prefix_projection,
         "spec.pmg.prefixHiddenSize sizes the prefix projection: set spec.pmg.prefixProjection true, or remove it"),
]


class PmgSpec(_Model):
    """PMG (personalized generation) options; only for spec.model.family pmg."""

    model_config = ConfigDict(json_schema_extra=entries(PMG_RULES))

    language_model: Optional[StorageUri] = Field(
        default=None,
        description="The frozen LLaMA-style causal LM (transformers layout). Unset = "
        "<spec.model.pretrained>/language_model.",
    )
    num_image_prompt: int = Field(
        default=2, ge=1, le=256, description="Trainable image-prompt tokens appended after the user's history.",
    )
    num_prefix_prompt: int = Field(
        default=2, ge=1, le=256, description="Length of the P-Tuning v2 prefix fed to every LM layer.",
    )
    max_sequence_length: int = Field(
        default=256, ge=8, le=8192, description="Tokens of user history the LM reads (longer is truncated).",
    )
    prefix_projection: bool = Field(
        default=False,
        description="P-Tuning v2's reparameterisation: produce the prefix through a two-layer MLP instead of "
        "training each layer's key/value prefix directly. Costly: at LLaMA-2-7B dimensions the MLP's last layer "
        "alone holds prefixHiddenSize x 262,144 weights (about 1.1 billion at the default size).",
    )
    prefix_hidden_size: Optional[int] = Field(
        default=None, ge=1, le=65536,
        description="prefixProjection only: the MLP's hidden size. Unset = the LM's hidden size.",
    )
    train_json: DataFileName = Field(
        default="data.json",
        description="The training records, a JSON list under spec.data.uri: {user_id, history: [texts], "
        "target_image, target_caption}, or the PMG guide's processed form {user_id or worker_id, "
        "history_items_info: [{caption, ...}], target_item_info: {caption, image_path}} (e.g. "
        "processed_dataset/train.json of FLICKR, POG or SER; image paths relative to spec.data.uri).",
    )
    val_json: Optional[DataFileName] = Field(
        default=None,
        description="Held-out records in the same form (e.g. processed_dataset/val.json), validated every "
        "spec.validation.everySteps; unset = spec.validation.heldOutFraction of trainJson.",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "PmgSpec":
        return enforce(PMG_RULES, self, info)



class CheckpointSpec(_Model):
    """Where checkpoints and the final adapter go, how often, and how many to keep."""

    uri: StorageUri = Field(description="Checkpoint directory: a local path or s3://bucket/prefix.")
    every_steps: int = Field(default=500, ge=1, le=10_000_000, description="Save a checkpoint every N optimizer steps.")
    keep_last: int = Field(default=3, ge=1, le=1000, description="Checkpoints to keep; older ones are deleted.")
    resume_from: Optional[ResumeSource] = Field(
        default=None,
        description="Where a new run starts. Unset: from scratch. latest: from the newest complete checkpoint "
        "of this job's earlier runs. A URI: that checkpoint, e.g. s3://bucket/prefix/ns/job/v0/checkpoint-500. "
        "A restarted pod of the same run always continues its own newest checkpoint.",
    )



DnsName = Annotated[str, Field(
    min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
)]
GPU_MEMORY_BOUNDS = ("1Gi", "4Ti")


def check_gpu_memory(value: str) -> str:
    from kubetune_api.quantity import parse_quantity

    low, high = (parse_quantity(bound, "bound") for bound in GPU_MEMORY_BOUNDS)
    if not low <= parse_quantity(value, "spec.resources.gpuMemory") <= high:
        raise ValueError(f"spec.resources.gpuMemory {value!r} is outside {GPU_MEMORY_BOUNDS[0]}-{GPU_MEMORY_BOUNDS[1]}")
    return value


# A memory size as a Kubernetes quantity: bytes with a decimal or binary suffix (no milli-bytes).
MemoryQuantity = Annotated[str, Field(
    pattern=r"^[0-9]+(\.[0-9]+)?(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$", max_length=64,
), AfterValidator(check_gpu_memory)]


class ResourcesSpec(_Model):
    """How many machines and accelerators the job uses, and what each pod requests."""

    nodes: int = Field(default=1, ge=1, le=1024, description="Nodes (pods); 1 = single node.")
    gpus_per_node: int = Field(default=1, ge=0, le=16, description="GPUs per node; 0 trains on CPU.")
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu", max_length=253, pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
        description="The extended resource that counts GPUs on your nodes.",
    )
    cpu: Optional[Quantity] = Field(default=None, description="CPU per pod (request = limit), e.g. 8 or 7500m.")
    memory: Optional[Quantity] = Field(default=None, description="Memory per pod (request = limit), e.g. 64Gi.")
    shm_size: Quantity = Field(
        default="1Gi", description="Size of the memory-backed /dev/shm (data loader workers and NCCL use it).",
    )
    cache_size: Optional[Quantity] = Field(
        default=None,
        description="Disk for the cache volume of each pod (models and data mirrored from S3, the embedding "
        "cache, checkpoints before upload): its size limit, and requested as ephemeral storage so the pod "
        "lands on a node with that much. Unset: limited to the operator's default (Helm value "
        "trainer.cacheSizeLimit), nothing requested.",
    )
    gpu_memory: Optional[MemoryQuantity] = Field(
        default=None,
        description="Memory of one GPU, e.g. 80Gi (1Gi-4Ti), for the fit check: `kubectl apply` warns and the "
        "FitsGpu condition turns False when the job's estimate exceeds it. Unset = the operator's default "
        "(Helm value trainer.gpuMemory).",
    )


DISTRIBUTED_RULES = [
    Rule("!has(self.cpuOffload) || !self.cpuOffload || self.strategy == 'fsdp'",
         lambda distributed: not distributed.cpu_offload or distributed.strategy == "fsdp",
         "spec.distributed.cpuOffload shards to CPU memory: it needs strategy fsdp"),
]


class DistributedSpec(_Model):
    """How the job's processes share the work: one process per GPU, across every node."""

    model_config = ConfigDict(json_schema_extra=entries(DISTRIBUTED_RULES))

    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        default="auto",
        description="ddp: every process holds the whole model and gradients are averaged; fsdp: parameters, "
        "gradients and optimizer state are sharded over all processes (FSDP2), for models that do not fit one "
        "GPU; auto: fsdp when the model does not fit a GPU under ddp (see `kubetune plan`), else ddp "
        "(always ddp on the CPU).",
    )
    processes_per_node: Optional[int] = Field(
        default=None, ge=1, le=64,
        description="Training processes per pod. Unset: one per GPU, or one on the CPU. CPU jobs may run "
        "several (they train together over gloo); a GPU job always runs one per GPU.",
    )
    cpu_offload: bool = Field(
        default=False,
        description="fsdp only: keep the sharded parameters, gradients and optimizer state in CPU memory "
        "between uses (CUDA GPUs; slower, for models that do not fit even sharded).",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "DistributedSpec":
        return enforce(DISTRIBUTED_RULES, self, info)


ENDPOINT_CREDENTIALS_MESSAGE = ("spec.s3.endpointUrl must not carry credentials (user:password@host): they would "
                                "be stored in plain text in the ConfigMap and the pods' environment; put them in "
                                "the Secret named by spec.s3.credentialsSecret")


def check_endpoint_url(value: str) -> str:
    if "@" in value.split("://", 1)[-1].split("/", 1)[0]:
        raise ValueError(ENDPOINT_CREDENTIALS_MESSAGE)
    return value


EndpointUrl = Annotated[str, Field(max_length=2048, pattern=r"^https?://[^\s]+$", json_schema_extra={
    "x-kubernetes-validations": [{"rule": "!self.matches('^https?://[^/]*@')", "message": ENDPOINT_CREDENTIALS_MESSAGE}],
}), AfterValidator(check_endpoint_url)]


class S3Spec(_Model):
    """How the trainer reaches S3 for s3:// URIs. Without a Secret the default AWS chain is used (IRSA)."""

    credentials_secret: Optional[DnsName] = Field(
        default=None,
        description="Name of a Secret in the job's namespace with keys AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY; passed to pods only as secretKeyRef.",
    )
    endpoint_url: Optional[EndpointUrl] = Field(
        default=None, description="S3 endpoint for MinIO or other S3-compatible stores; unset = AWS.",
    )
    region: Optional[Annotated[str, Field(max_length=64, pattern=r"^[a-z0-9-]+$")]] = Field(
        default=None, description="S3 region; unset = the operator's default.",
    )
    path_style: Optional[bool] = Field(
        default=None, description="Path-style addressing (MinIO and most self-hosted stores); unset = automatic.",
    )


# An MLflow tracking server: http(s)://host[:port][/path], nothing else (no user:password@, no query,
# no fragment). The same expression for the API server (CEL, RE2) and Python (re.fullmatch).
_MLFLOW_URI = (r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?"
               r"(/[A-Za-z0-9._~!$&()*+,;=:@%/-]*)?$")
MLFLOW_URI_MESSAGE = ("spec.tracking.mlflow.uri must be an MLflow tracking server's http(s)://host[:port][/path], "
                      "e.g. http://mlflow.mlops.svc:5000 (no credentials, query or fragment)")
MLFLOW_URI_CREDENTIALS_MESSAGE = ("spec.tracking.mlflow.uri must not carry credentials (user:password@host): the "
                                  "spec is stored, shown and logged in plain text")


def check_mlflow_uri(value: str) -> str:
    if "@" in value.split("://", 1)[-1].split("/", 1)[0]:
        raise ValueError(MLFLOW_URI_CREDENTIALS_MESSAGE)
    if not re.fullmatch(_MLFLOW_URI, value):
        raise ValueError(MLFLOW_URI_MESSAGE)
    return value


MlflowUri = Annotated[str, Field(min_length=1, max_length=2048, json_schema_extra={
    "x-kubernetes-validations": [{"rule": "self.matches('" + _MLFLOW_URI.replace("\\", "\\\\") + "')",  # CEL escapes
                                  "message": MLFLOW_URI_MESSAGE}],
}), AfterValidator(check_mlflow_uri)]


class MlflowSpec(_Model):
    """An MLflow tracking server that records the run: its hyperparameters (flattened spec paths such as
    training.learningRate), per-step metrics (train/loss, train/lr, validation/<metric>) and the final weights
    as artifacts. Only the main process logs; an unreachable server never stops training."""

    uri: MlflowUri = Field(
        description="The tracking server, http(s)://host[:port][/path], e.g. http://mlflow.mlops.svc:5000. Run it "
        "with --serve-artifacts: the final weights are then uploaded through the server, and the trainer needs no "
        "credentials of the artifact store. The trainers' network policy must allow reaching it (Helm value "
        "networkPolicy.trainerEgress).",
    )
    experiment: str = Field(
        default="kubetune", min_length=1, max_length=256, pattern=r"^\S(.*\S)?$",
        description="The MLflow experiment the run is logged in; created when missing.",
    )
    parent_run_id: Optional[str] = Field(
        default=None, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$",
        description="Log this run as a child of that MLflow run (tag mlflow.parentRunId). A TrainingSweep sets it "
        "on each trial to the sweep's own parent run; unset = a top-level run.",
    )


class TrackingSpec(_Model):
    """Experiment trackers that record the run, besides TensorBoard and the Prometheus metrics."""

    mlflow: Optional[MlflowSpec] = Field(default=None, description="Log the run to an MLflow tracking server.")


class Toleration(_Model):
    """A Kubernetes toleration, passed to the training pods as is."""

    key: Optional[str] = Field(default=None, max_length=316, description="Taint key.")
    operator: Optional[Literal["Exists", "Equal"]] = Field(default=None, description="Exists or Equal.")
    value: Optional[str] = Field(default=None, max_length=63, description="Taint value.")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = Field(
        default=None, description="Taint effect.",
    )
    toleration_seconds: Optional[int] = Field(default=None, ge=0, description="For NoExecute: seconds to stay.")


WORKLOAD_PRIORITY_NEEDS_QUEUE = ("spec.scheduling.workloadPriorityClass orders jobs in a Kueue queue: set "
                                 "spec.scheduling.queueName too, or use priorityClassName for a pod priority")


SCHEDULING_RULES = [
    Rule("!has(self.workloadPriorityClass) || has(self.queueName)",
         lambda scheduling: not scheduling.workload_priority_class or bool(scheduling.queue_name),
         WORKLOAD_PRIORITY_NEEDS_QUEUE),
]


class SchedulingSpec(_Model):
    """Where and under which identity the training pods run; passed through to the pods."""

    model_config = ConfigDict(json_schema_extra=entries(SCHEDULING_RULES))

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description="Taints the pods tolerate.")
    affinity: Optional[dict[str, Any]] = Field(default=None, description="A Kubernetes Affinity object.")
    priority_class_name: Optional[DnsName] = Field(default=None, description="PriorityClass of the pods.")
    queue_name: Optional[DnsName] = Field(
        default=None, description="Kueue LocalQueue: set as the kueue.x-k8s.io/queue-name label.",
    )
    workload_priority_class: Optional[DnsName] = Field(
        default=None, description="Kueue WorkloadPriorityClass: the job's priority in its queue (who waits, who is "
        "preempted), set as the kueue.x-k8s.io/priority-class label; needs queueName. Works with every backend.",
    )
    service_account_name: Optional[DnsName] = Field(
        default=None, description="ServiceAccount of the training pods (e.g. one bound to an IAM role).",
    )
    service_account_token: bool = Field(
        default=False,
        description="Mount the ServiceAccount's API token in the training pods (off: the trainer never calls the "
        "Kubernetes API; IRSA, EKS Pod Identity and GKE Workload Identity do not need it). For code of your own "
        "that talks to the API server.",
    )
    image_pull_secrets: list[DnsName] = Field(
        default_factory=list, max_length=16, description="Secrets for pulling the trainer image.",
    )

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "SchedulingSpec":
        return enforce(SCHEDULING_RULES, self, info)


class RunPolicySpec(_Model):
    """Lifetime limits of the run."""

    backoff_limit: int = Field(default=3, ge=0, le=100, description="Pod restarts on retryable failures before Failed.")
    active_deadline_seconds: Optional[int] = Field(
        default=None, ge=1, description="Fail the job when it has run longer than this.",
    )
    ttl_seconds_after_finished: Optional[int] = Field(
        default=None, ge=0, description="Delete the child job this long after it finished (the TrainingJob stays).",
    )


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
                or not _resolution_ok(spec.data.resolution) or all(side % multiple == 0 for side in spec.size),
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
        if spec.model.family != family or frames is None or not _frames_ok(frames):
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


class TrainingJobSpec(_Model):
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


class Condition(_Model):
    """A Kubernetes-style condition: one aspect of the job's state, with why and since when."""

    type: str = Field(max_length=316, description="Condition type, e.g. Ready, Succeeded, Failed.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", max_length=1024, description="CamelCase reason for the last transition.")
    message: str = Field(default="", max_length=32768, description="Human-readable details.")
    last_transition_time: Optional[str] = Field(default=None, description="When status last changed (RFC 3339).")


class Progress(_Model):
    """Training progress as the trainer reports it."""

    step: int = Field(default=0, ge=0, description="Optimizer steps done.")
    total_steps: int = Field(default=0, ge=0, description="Optimizer steps planned.")
    percent: float = Field(default=0, ge=0, le=100, description="step / totalSteps in percent.")
    eta_seconds: Optional[float] = Field(default=None, ge=0, description="Estimated seconds to finish.")
    loss: Optional[float] = Field(default=None, description="Latest training loss.")
    recent_loss: Optional[float] = Field(default=None, description=f"Mean training loss of the latest "
                                         f"{RECENT_LOSS_STEPS} steps: a sweep's loss objective.")


class CheckpointMark(_Model):
    """The newest complete checkpoint as the trainer reports it."""

    step: int = Field(ge=0, description="The step it holds.")
    time: Optional[str] = Field(default=None, description="When it was written (RFC 3339); unset for one written "
                                "before the operator saw the run (a resumed run's starting checkpoint).")


class UnsavedWork(_Model):
    """Work a stop without a final checkpoint would lose, while the job runs: what a preemption costs."""

    steps: int = Field(ge=0, description="Optimizer steps done since the newest complete checkpoint.")
    seconds: int = Field(ge=0, description="Seconds of training since that checkpoint's state was taken (or since "
                         "this attempt started training, if later).")


class ValidationResult(_Model):
    """The latest validation as the trainer reports it."""

    step: int = Field(ge=0, description="The step it validated at.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="What it measured on the held-out data, by name (loss; accuracy "
        "and f1 for classifiers; clip_score or clip_directional with spec.validation.clipModel): a sweep's "
        "trial objective.",
    )


class Generation(_Model):
    """One `kubetune generate --on-cluster` request (the kubetune.dev/generate annotation) as the operator
    answers it: the batch Job that draws it and where the images go."""

    id: str = Field(max_length=64, description="The request's id (in the annotation, the Job's name and the folder).")
    phase: Literal["Running", "Succeeded", "Failed"] = Field(description="Running, Succeeded or Failed.")
    uri: Optional[str] = Field(default=None, description="Where the PNGs and grid.png go: "
                               "<outputUri>/generated/<step>[-compare]-<id>.")
    job: Optional[str] = Field(default=None, description="The batch Job that draws them.")
    message: Optional[str] = Field(default=None, max_length=32768, description="Why it failed.")
    start_time: Optional[str] = Field(default=None, description="When the Job started (RFC 3339).")
    completion_time: Optional[str] = Field(default=None, description="When it finished (RFC 3339).")


class TrainingJobStatus(_Model):
    """What the operator observed."""

    phase: Literal["Pending", "Running", "Succeeded", "Failed", "Suspended"] = Field(
        default="Pending", description="Pending, Running, Succeeded, Failed or Suspended."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Detailed state.")
    start_time: Optional[str] = Field(default=None, description="When training started (RFC 3339).")
    completion_time: Optional[str] = Field(default=None, description="When the job finished (RFC 3339).")
    progress: Optional[Progress] = Field(default=None, description="Latest progress from the trainer.")
    output_uri: Optional[str] = Field(
        default=None, description="This run's directory: <checkpoints.uri>/<namespace>/<name>/v<N> "
        "(checkpoints, final weights, logs).",
    )
    latest_checkpoint: Optional[str] = Field(default=None, description="URI of the newest complete checkpoint.")
    last_checkpoint: Optional[CheckpointMark] = Field(
        default=None, description="The newest complete checkpoint's step and time, read from the trainer.")
    unsaved_work: Optional[UnsavedWork] = Field(
        default=None, description="Work done since the newest complete checkpoint, while the job runs (removed "
        "once it stops: a stopping trainer writes a last checkpoint).")
    priority_boost: Optional[int] = Field(
        default=None, description="The kueue.x-k8s.io/priority-boost kubetune keeps on the job's Kueue Workload "
        "for its unsaved work (the chart's kueue.preemptionCost).")
    report_uri: Optional[str] = Field(
        default=None, description="URI of the run's report (report.html in the run's directory: curves, validation "
        "grids, the resolved spec, where the weights are), set when the job succeeds. The trainer writes it last; "
        "where writing it failed (a warning in the trainer's log) `kubetune report` writes one from the run.",
    )
    validation: Optional[ValidationResult] = Field(
        default=None, description="The latest validation's metrics, read from the trainer while it runs "
        "(spec.validation.everySteps with held-out data).",
    )
    observed_generation: Optional[int] = Field(default=None, description="The spec generation last acted on.")
    backend: Optional[str] = Field(default=None, description="The backend running the job (pytorchjob or trainjob).")
    generations: list[Generation] = Field(
        default_factory=list, description="The latest `kubetune generate --on-cluster` requests (at most 10), "
        "each with its phase and the URI of its images.")


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


class ObjectMeta(_Model):
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


class TrainingJob(_Model):
    """A whole TrainingJob manifest, as written to `kubectl apply`."""

    api_version: Literal[API_GROUP_VERSION] = Field(description=API_GROUP_VERSION)
    kind: Literal["TrainingJob"] = Field(description="TrainingJob")
    metadata: ObjectMeta
    spec: TrainingJobSpec
    status: Optional[TrainingJobStatus] = Field(default=None, description="Written by the operator.")
