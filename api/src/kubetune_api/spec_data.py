"""spec.data: the training data (layout, stored format, columns, sizes, frames, augmentation, the embedding
cache and streaming from S3)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from kubetune_api.data_layouts import DATA_LAYOUTS, layouts_where, stored_as
from kubetune_api.rules import Rule, enforce, entries
from kubetune_api.spec_base import SpecModel
from kubetune_api.spec_uris import StorageUri


Layout = Literal[tuple(DATA_LAYOUTS)]
# The layouts whose samples are video clips: they take spec.data.frames (needed) and fps.
VIDEO_LAYOUTS = layouts_where(clips=True)
# The layouts that read metadata.jsonl, whose keys spec.data.imageColumn and captionColumn name.
METADATA_LAYOUTS = layouts_where(metadata=True)
# Layouts whose stored forms have a caption column though their loose files have no metadata.jsonl.
STORED_CAPTION_LAYOUTS = tuple(name for name, row in DATA_LAYOUTS.items()
                               if row.stored and row.captioned and not row.metadata)


def layout_in(names: tuple[str, ...]) -> str:
    """CEL: spec.data.layout is one of names."""
    return f"self.layout == '{names[0]}'" if len(names) == 1 else f"self.layout in {list(names)}"


class CacheSpec(SpecModel):
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


class StreamingSpec(SpecModel):
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


def resolution_ok(value: int | list[int]) -> bool:
    sides = [value] if isinstance(value, int) else value
    return (isinstance(value, int) or len(value) == 2) and all(8 <= side <= 4096 and side % 8 == 0 for side in sides)


# One count, or several (frame-count buckets: each clip trains at the longest it holds). Untyped in
# the CRD as spec.data.resolution is, for the same reason: its rules are the webhook's alone.
Frames = Union[int, list[int]]
MAX_FRAMES = 1024


def frame_counts(frames: Frames | None) -> list[int]:
    """spec.data.frames as a list of counts (none when unset)."""
    return [] if frames is None else [frames] if isinstance(frames, int) else list(frames)


def frames_ok(value: Frames) -> bool:
    counts = frame_counts(value)
    return (isinstance(value, int) or 1 <= len(value) <= 16 and len(set(value)) == len(value)) \
        and all(1 <= count <= MAX_FRAMES for count in counts)


@dataclass(frozen=True)
class DataFormat:
    """How one spec.data.format stores samples: the names its columns go by when the spec names none (the
    Hugging Face conventions of each). The layouts it can hold are their rows' (data_layouts.stored_as)."""

    image_column: str | None    # None: a WebDataset sample's image member, whatever its extension
    caption_column: str
    label_column: str | None    # None: labels are not in columns (files: the class folders)
    control_column: str | None  # edit-pairs: where the control images are (None: control_images/)
    description: str
    video_column: str | None = None  # the video layouts' image column (None: a WebDataset clip member)


DATA_FORMATS: dict[str, DataFormat] = {
    "files": DataFormat("file_name", "text", None, None,  # every layout's own loose files
                        "loose files as the layout describes them", video_column="file_name"),
    "parquet": DataFormat("image", "text", "label",
                          "control_image",
                          "*.parquet files as Hugging Face datasets saves them: an image column of {bytes, path} "
                          "structs, bytes, or paths relative to the data folder, and a caption (or label) column; "
                          "edit pairs add a control image column (one image or a list of them); video-captions "
                          "reads clips from a video column alike",
                          video_column="video"),
    "webdataset": DataFormat(None, "text", "label",
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
    media = row.video_column if DATA_LAYOUTS[data.layout].clips else row.image_column
    return (data.image_column or media, data.caption_column or row.caption_column,
            data.label_column or row.label_column, data.control_column or row.control_column)


DATA_RULES = [
    Rule(None,  # the CRD leaves the number-or-list untyped: CEL cannot name it (rules.Rule)
         lambda data: data.resolution is None or resolution_ok(data.resolution),
         "spec.data.resolution: give one side for a square (512, 1024) or [width, height] (e.g. [832, 576]), "
         "each 8 to 4096 pixels in multiples of 8"),
    Rule(" || ".join(f"(self.format == '{name}' && self.layout in {list(stored_as(name))})"
                     for name, row in DATA_FORMATS.items()),
         lambda data: data.layout in stored_as(data.format),
         "spec.data.format does not fit spec.data.layout: "
         + "; ".join(f"{name} stores {', '.join(stored_as(name))}" for name in DATA_FORMATS)
         + " (use format files, loose files, for the others)"),
    Rule(f"!has(self.captionColumn) || {layout_in(METADATA_LAYOUTS)} || ({layout_in(STORED_CAPTION_LAYOUTS)} "
         "&& self.format != 'files')",
         lambda data: data.caption_column is None or data.layout in METADATA_LAYOUTS
         or (data.layout in STORED_CAPTION_LAYOUTS and data.format != "files"),
         "spec.data.captionColumn names the captions of the captions and video-captions layouts, or the "
         "instructions of edit pairs stored as parquet or webdataset: remove it for this layout"),
    Rule(f"!has(self.controlColumn) || ({layout_in(layouts_where(edits=True))} && self.format != 'files')",
         lambda data: data.control_column is None or (DATA_LAYOUTS[data.layout].edits and data.format != "files"),
         "spec.data.controlColumn names the control images of edit pairs stored as parquet or webdataset: "
         "remove it (loose edit pairs keep them in control_images/)"),
    Rule(f"!has(self.imageColumn) || {layout_in(METADATA_LAYOUTS)} || self.format != 'files'",
         lambda data: data.image_column is None or data.layout in METADATA_LAYOUTS or data.format != "files",
         "spec.data.imageColumn names metadata.jsonl's image (clip) key in the captions and video-captions layouts, "
         "or the image column of format parquet or webdataset: remove it for this layout's loose files"),
    Rule(f"!has(self.labelColumn) || ({layout_in(layouts_where(labels=True))} && self.format != 'files')",
         lambda data: data.label_column is None or (DATA_LAYOUTS[data.layout].labels and data.format != "files"),
         "spec.data.labelColumn names the label column of the image-folder layout stored as format parquet or "
         "webdataset: remove it (loose image-folder files are labelled by their class folders)"),
    Rule(None,  # untyped number-or-list (rules.Rule)
         lambda data: data.frames is None or frames_ok(data.frames),
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


class DataSpec(SpecModel):
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
        + " and ".join(stored_as("parquet")) + " data.",
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
