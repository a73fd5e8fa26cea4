"""The image-folder layout for classification: CLASS/NAME.png, one folder per label."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_trainer.data.edit_pairs import IMAGE_SUFFIXES
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.screening import Screen
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
