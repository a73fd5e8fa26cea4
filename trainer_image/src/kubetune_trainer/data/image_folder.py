"""The image-folder layout for classification: CLASS/NAME.png, one folder per label."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.edit_pairs import IMAGE_SUFFIXES
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.layout_parts import Layout
from kubetune_trainer.data.records import Stored
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.stored import read_stored
from kubetune_trainer.data.tiny_drawing import COLOURS, SHAPES, draw_shape
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, inside


@dataclass(frozen=True)
class LabelledImage:
    path: Path
    label: int


def read_image_folder(root: Path, screen: Screen) -> tuple[list[LabelledImage], list[str]]:
    """Samples and class names (sorted folder names: label i is classes[i])."""
    if not root.is_dir():
        raise FileNotFoundError(f"spec.data.uri: {root} is not a directory")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        raise ConfigError(f"spec.data.uri: the image-folder layout needs at least two class folders "
                          f"CLASS/NAME.png in {root}; found {classes}")
    samples = []
    for label, name in enumerate(classes):
        for path in sorted((root / name).iterdir()):
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                samples.append(LabelledImage(inside(root, path, "image"), label))
            except UnsafePath as err:
                screen.reject(str(path), str(err))
    return samples, classes


def loose_samples(root: Path) -> list[tuple[Path, str, str, tuple[Path, ...]]]:
    """The data set as data.restore_data stores it again: (image, its name, class name, no controls) each."""
    samples, classes = read_image_folder(root, Screen(skip_bad=False))
    return [(s.path, s.path.relative_to(root).as_posix(), classes[s.label], ()) for s in samples]


class ImageFolderDataset(KeyedDataset):
    def __init__(self, samples: list[LabelledImage], transform: ImageTransform, seed: int):
        super().__init__(samples, [s.path for s in samples], transform, seed, bucketing=False)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        sample = self.samples[key[1]]
        pixels, _ = self.load_image(sample.path, key[1], self.rng(key))
        return {"pixel_values": pixels, "label": sample.label}


def collate(items: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "labels": torch.tensor([item["label"] for item in items]),
    }


# ---- the layout's parts (kubetune_api.data_layouts' row for it says what it is) ----

def read(spec: TrainingJobSpec, screen: Screen) -> list:
    samples, _classes = read_image_folder(Path(spec.data.uri), screen)
    return samples


def dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    return ImageFolderDataset(samples, transform, spec.training.seed)


def from_stored(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
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


def read_labelled(spec: TrainingJobSpec, screen: Screen) -> tuple[list[LabelledImage], list[str]]:
    """Samples and class names of spec.data.uri in spec.data.format: class folders, or the labels
    a parquet file or a shard stores."""
    if spec.data.format == "files":
        return read_image_folder(Path(spec.data.uri), screen)
    return labelled_and_classes(read_stored(spec, screen), screen)


def write_tiny(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0) -> Path:
    """CLASS/NAME.png with the shape as the class (square, circle)."""
    rng = random.Random(seed)
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        (out_dir / shape).mkdir(parents=True, exist_ok=True)
        draw_shape(rng.choice(list(COLOURS)), shape, size, rng).save(out_dir / shape / f"{i:04d}.png")
    return out_dir


LAYOUT = Layout(read, dataset, collate, write_tiny, from_stored=from_stored, loose=loose_samples)
