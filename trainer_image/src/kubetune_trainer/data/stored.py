"""Samples of spec.data.format parquet and webdataset: each format's reader yields Stored records
(an image path, its caption or label as stored), and the layouts make their samples of them.

The records come in the data set's own order (files and shards by name, rows and members as they
lie in each), and each image is named as its loose file was (a parquet image's path, a shard
member's name): the same samples stored as loose files, as parquet or as WebDataset are then the
same list in the same order, so the sampler draws the same steps and training gives the same weights.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kubetune_api.spec import VIDEO_LAYOUTS, TrainingJobSpec, data_columns
from kubetune_trainer.data import node_index
from kubetune_trainer.data.data_files import files_with
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError

INDEX_THREADS = 8  # containers are indexed in parallel: a streamed one costs a few ranged GETs


@dataclass(frozen=True)
class Stored:
    image: Path               # a loose file, or a member path (storage.members)
    where: str                # how messages name the sample: "FILE row 3", "SHARD sample 0003"
    caption: object = None    # as stored (a caption must be text)
    label: object = None      # as stored: a class index, or a class name
    classes: tuple[str, ...] | None = None  # the names of the class indices, where the file has them
    controls: tuple[Path, ...] = ()         # edit pairs: the control images, in order


@dataclass(frozen=True)
class Columns:
    image: str | None
    caption: str
    label: str | None
    control: str | None
    wanted: str               # "caption" or "label": which of the two the layout reads
    edits: bool = False       # edit pairs: control images too (the caption is the instruction)
    clips: bool = False       # a video layout: the "image" of a sample is a video clip


def columns_of(spec: TrainingJobSpec) -> Columns:
    image, caption, label, control = data_columns(spec.data)
    return Columns(image, caption, label, control, "label" if spec.data.layout == "image-folder" else "caption",
                   edits=spec.data.layout == "edit-pairs", clips=spec.data.layout in VIDEO_LAYOUTS)


def data_files(root: Path, suffix: str) -> list[Path]:
    """The data set's files with SUFFIX, by name (the order of its samples), member copies aside."""
    if not root.is_dir():
        raise FileNotFoundError(f"spec.data.uri: {root} is not a directory")
    return files_with(root, (suffix,))


def read_containers(root: Path, screen: Screen, suffix: str, what: str, index: Callable[[Path], list],
                    reading: str) -> list[Stored]:
    """Every record of the data set's containers (files with SUFFIX, `what` names them when there are
    none): each indexed in parallel into Stored records and problems (once per node where streamed:
    data.node_index; READING names the format and columns the index reads), the problems reported
    to the screen in the containers' order, as they lie."""
    containers = data_files(root, suffix)
    if not containers:
        raise ConfigError(f"spec.data.uri: {root} holds no {what}")
    with ThreadPoolExecutor(INDEX_THREADS) as pool:
        indexed = list(pool.map(lambda container: node_index.indexed(container, reading, index), containers))
    records = []
    for found in indexed:
        for item in found:
            if isinstance(item, Stored):
                records.append(item)
            else:
                screen.reject(*item)
    return records


def read_stored(spec: TrainingJobSpec, screen: Screen) -> list[Stored]:
    from kubetune_trainer.data import parquet, webdataset

    readers = {"parquet": parquet.read_parquet, "webdataset": webdataset.read_webdataset}
    records = readers[spec.data.format](Path(spec.data.uri), screen, columns_of(spec))
    if not records:
        raise ConfigError(f"spec.data.uri: {spec.data.uri} holds no usable samples (spec.data.format "
                          f"{spec.data.format})")
    return records


def captioned(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    from kubetune_trainer.data.captions import CaptionedImage

    samples = []
    for record in records:
        if not isinstance(record.caption, str):
            screen.reject(record.where, f"its caption is {type(record.caption).__name__}, not text; give every "
                                        "sample a caption (spec.data.captionColumn names where it is)")
            continue
        samples.append(CaptionedImage(record.image, record.caption))
    return samples


def captioned_clips(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    """Video-captions samples: captioned as images are; each clip is then probed by the layout's check."""
    from kubetune_trainer.data.video_captions import CaptionedClip

    return [CaptionedClip(sample.path, sample.caption) for sample in captioned(records, spec, screen)]


def labelled(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    return labelled_and_classes(records, screen)[0]


def labelled_and_classes(records: list[Stored], screen: Screen) -> tuple[list, list[str]]:
    """The image-folder samples and the class names (label i is classes[i]): class indices as stored,
    named as the data set names them (a ClassLabel) or by number; class names numbered in sorted
    order, as class folders are."""
    from kubetune_trainer.data.image_folder import LabelledImage

    usable = []
    for record in records:
        if isinstance(record.label, bool) or not isinstance(record.label, (int, str)) or record.label == "" \
                or (isinstance(record.label, int) and record.label < 0):
            screen.reject(record.where, f"its label is {record.label!r}; give every sample a class index or name "
                                        "(spec.data.labelColumn names where it is)")
            continue
        usable.append(record)
    if len({type(r.label) for r in usable}) > 1:
        raise ConfigError(f"spec.data.labelColumn: {usable[0].where} and others mix class indices and class "
                          "names; label every sample one way")
    if usable and isinstance(usable[0].label, str):
        classes = sorted({r.label for r in usable})
        return [LabelledImage(r.image, classes.index(r.label)) for r in usable], classes
    count = max((r.label for r in usable), default=-1) + 1
    named = next((r.classes for r in usable if r.classes), None)
    classes = list(named) if named and len(named) >= count else [str(i) for i in range(count)]
    return [LabelledImage(r.image, r.label) for r in usable], classes


def edit_pairs(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    """Edit pairs: a target image, its control images (as many as the family's row allows) and a
    non-empty instruction, as loose edit pairs are checked (data.edit_pairs)."""
    from kubetune_api.families import FAMILIES
    from kubetune_trainer.data.edit_pairs import EditPair

    family = spec.model.family
    most = FAMILIES[family].max_references
    pairs = []
    for record in records:
        if not record.controls:
            screen.reject(record.where, "has no control image (spec.data.controlColumn names where they are)")
        elif len(record.controls) > most:
            screen.reject(record.where, f"has {len(record.controls)} control images; spec.model.family {family} "
                                        f"takes at most {most}")
        elif not isinstance(record.caption, str) or not record.caption.strip():
            screen.reject(record.where, "has no instruction: an edit pair needs its instruction "
                                        "(spec.data.captionColumn names where it is)")
        else:
            pairs.append(EditPair(record.controls, record.image, record.caption.strip()))
    return pairs
