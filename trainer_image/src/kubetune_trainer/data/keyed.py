"""What every layout's data set shares: items by (epoch, index) key, buckets, a held-out split."""
from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from PIL import Image

from kubetune_trainer.data.buckets import assign_buckets, buckets_of_sizes
from kubetune_trainer.data.images import Crop, ImageTransform
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.data.image_input import ImageRefused, to_rgb
from kubetune_trainer.storage.stream import NotARegularFile, describe, open_image

Sample = TypeVar("Sample")


def split_held_out(samples: Sequence[Sample], fraction: float, name: Callable[[Sample], str]
                   ) -> tuple[list[Sample], list[Sample]]:
    """(training, held out): the held-out part is chosen by a hash of each sample's name, so it stays
    the same across runs, process counts and added data, and never depends on the shuffle."""
    if fraction <= 0:
        return list(samples), []
    ranked = sorted(samples, key=lambda s: hashlib.sha256(name(s).encode()).hexdigest())
    count = min(len(samples) - 1, max(1, math.floor(fraction * len(samples))))
    held = {id(s) for s in ranked[:count]}
    return [s for s in samples if id(s) not in held], [s for s in samples if id(s) in held]


def combined_groups(buckets: Sequence[int] | None, kinds: Sequence[int] | None) -> list[int] | None:
    """One group id per sample for (bucket, kind); the buckets themselves where every kind is the same."""
    if kinds is None or len(set(kinds)) <= 1:
        return None if buckets is None else list(buckets)
    pairs = list(zip(buckets if buckets is not None else [0] * len(kinds), kinds))
    ids = {pair: number for number, pair in enumerate(sorted(set(pairs)))}
    return [ids[pair] for pair in pairs]


class KeyedDataset(torch.utils.data.Dataset):
    """Items are looked up by (epoch, index) so augmentations are reproducible on resume.

    `groups` is what the sampler batches by (None: any samples batch together): each sample's
    aspect-ratio bucket (`buckets`, None without bucketing) and, where a layout's samples differ in
    shape otherwise (`kinds`: e.g. edit pairs' number of control images), that too. `sizes`: each
    sample's (width, height) where the layout knows it (video clips), else read from the images' headers.
    """

    def __init__(self, samples: Sequence, image_paths: list[Path], transform: ImageTransform, seed: int,
                 bucketing: bool, kinds: Sequence[int] | None = None,
                 sizes: Sequence[tuple[int, int]] | None = None):
        self.samples = list(samples)
        self.transform = transform
        self.seed = seed
        if not bucketing:
            self.buckets, self.bucket_sizes = None, None
        elif sizes is not None:
            self.buckets, self.bucket_sizes = buckets_of_sizes(list(sizes), transform.resolution)
        else:
            self.buckets, self.bucket_sizes = assign_buckets(image_paths, transform.resolution)
        self.groups = combined_groups(self.buckets, kinds)

    def __len__(self) -> int:
        return len(self.samples)

    def rng(self, key: tuple[int, int]) -> random.Random:
        epoch, index = key
        return random.Random(f"{self.seed}:{epoch}:{index}")

    def load_image(self, path: Path, index: int, rng: random.Random,
                   flip: bool | None = None) -> tuple[torch.Tensor, Crop]:
        size = self.bucket_sizes[self.buckets[index]] if self.buckets is not None else None
        crop_rng = random.Random(f"{self.seed}:crop:{index}") if self.transform.crop_per_sample else None
        try:
            with open_image(path) as image:
                pixels = to_rgb(image)  # bounds, orientation, mode rules; decodes: a broken file fails here
        except (ImageRefused, NotARegularFile) as err:
            raise ConfigError(f"{describe(path)}: {err}; fix or remove it") from None
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:  # screened before training unless streamed
            raise ConfigError(f"{describe(path)}: cannot be read as an image ({type(err).__name__}: {err}); streamed images "
                              "are checked as training reaches them: fix or remove it (with "
                              "spec.data.streaming.enabled false every image is checked before training, "
                              "and spec.data.skipBad applies)") from None
        return self.transform.apply(pixels, rng, size, flip, crop_rng)
