"""Samples of spec.data.format parquet and webdataset: each format's reader yields Stored records
(data.records: an image path, its caption or label as stored), and the layouts make their samples of
them here (the image-folder layout's labelled samples from either form: read_labelled).

The records come in the data set's own order (files and shards by name, rows and members as they
lie in each), and each image is named as its loose file was (a parquet image's path, a shard
member's name): the same samples stored as loose files, as parquet or as WebDataset are then the
same list in the same order, so the sampler draws the same steps and training gives the same weights.
"""
from __future__ import annotations

from pathlib import Path

from kubetune_api.families import FAMILIES
from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data import parquet, webdataset
from kubetune_trainer.data.captions import CaptionedImage
from kubetune_trainer.data.edit_pairs import EditPair
from kubetune_trainer.data.image_folder import LabelledImage, read_image_folder
from kubetune_trainer.data.records import Stored, columns_of
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.video_captions import CaptionedClip
from kubetune_trainer.errors import ConfigError


def read_stored(spec: TrainingJobSpec, screen: Screen) -> list[Stored]:
    readers = {"parquet": parquet.read_parquet, "webdataset": webdataset.read_webdataset}
    records = readers[spec.data.format](Path(spec.data.uri), screen, columns_of(spec))
    if not records:
        raise ConfigError(f"spec.data.uri: {spec.data.uri} holds no usable samples (spec.data.format "
                          f"{spec.data.format})")
    return records


def captioned(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
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
    return [CaptionedClip(sample.path, sample.caption) for sample in captioned(records, spec, screen)]


def labelled(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    return labelled_and_classes(records, screen)[0]


def labelled_and_classes(records: list[Stored], screen: Screen) -> tuple[list, list[str]]:
    """The image-folder samples and the class names (label i is classes[i]): class indices as stored,
    named as the data set names them (a ClassLabel) or by number; class names numbered in sorted
    order, as class folders are."""
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


def read_labelled(spec: TrainingJobSpec, screen: Screen) -> tuple[list[LabelledImage], list[str]]:
    """Samples and class names of spec.data.uri in spec.data.format: class folders, or the labels
    a parquet file or a shard stores."""
    if spec.data.format == "files":
        return read_image_folder(Path(spec.data.uri), screen)
    return labelled_and_classes(read_stored(spec, screen), screen)
