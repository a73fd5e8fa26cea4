"""Bad samples are found before training, not at step 7 of 8: each is refused naming its file, or
skipped and counted when the job says `spec.data.skipBad: true`.

Readers report record-level problems (a broken metadata line, a caption that is not text, a file
name that leaves the data set) through `Screen.reject`; then every image is opened, verified and
fully decoded once (`image_problem`): truncated files, files that are not images, and images over
Pillow's decompression-bomb limit are caught here. A layout of other files gives the Screen its own
check of one file (data.video.ClipCheck for video clips). Processes split the files between them and
share what they found, so every process keeps the same samples (and a check that takes the others'
findings, `share`, gets them: a clip probed by one process is not probed again by the others).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image

from kubetune_trainer.errors import ConfigError
from kubetune_trainer.data.image_input import ImageRefused, check_bounds, oriented_size, to_rgb
from kubetune_trainer.storage.stream import NotARegularFile, describe, open_image

CHECK_THREADS = 4  # decoding releases the GIL: a few threads keep the disk and the cores busy
# One file's check: (why it cannot be trained on or None, what it found when it can: the file's
# (width, height), or an object with a `size` (a clip's ClipInfo)).
FileCheck = Callable[[Path], tuple[str | None, Any]]


def _size_of(found) -> tuple[int, int]:
    return found if isinstance(found, tuple) else found.size


def image_problem(path: Path) -> str | None:
    """Why an image cannot be trained on, or None when it can."""
    return _checked(path)[0]


def _checked(path: Path) -> tuple[str | None, tuple[int, int] | None]:
    """(why the image cannot be trained on or None, its (width, height) as trained, oriented)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with open_image(path) as image:  # a loose file, or an image inside a parquet file or shard
                check_bounds(image.size)  # from the header, before anything is decoded
                image.verify()  # the container: chunks, checksums
            with open_image(path) as image:
                size = oriented_size(image)
                to_rgb(image)  # the pixels as trained: a truncated file or a mode not converted fails here
                return None, size
    except (ImageRefused, NotARegularFile) as err:  # a size, a mode or a kind of file: the reason says which
        return str(err), None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return f"is larger than {Image.MAX_IMAGE_PIXELS} pixels (a decompression bomb?)", None
    except (OSError, SyntaxError, ValueError, Image.UnidentifiedImageError) as err:
        return f"cannot be read as an image ({type(err).__name__}: {err})", None


@dataclasses.dataclass(frozen=True)
class SmallImages:
    """Images smaller than the training size on either side (they are upscaled: blurrier than their peers)."""

    count: int
    checked: int
    smallest: tuple[int, int]   # (width, height) of the one with the fewest pixels
    path: Path

    def warning(self, size: tuple[int, int]) -> str:
        width, height = self.smallest
        return (f"{self.count} of {self.checked} images are smaller than the training size {size[0]}x{size[1]} "
                f"and will be upscaled; the smallest is {width}x{height} ({self.path}); lower "
                "spec.data.resolution or replace them for sharper results")


def image_paths(sample) -> list[Path]:
    """The images a sample reads: its Path fields, and those in its tuple fields (edit pairs' controls)."""
    paths = []
    for value in (getattr(sample, f.name) for f in dataclasses.fields(sample)):
        paths += [item for item in (value if isinstance(value, tuple) else (value,)) if isinstance(item, Path)]
    return paths


class Screen:
    def __init__(self, skip_bad: bool, check: FileCheck | None = None):
        self.skip_bad = skip_bad
        self.check = check or _checked  # each file of a sample: an image by default
        self.skipped: list[str] = []
        self.small: SmallImages | None = None  # set by images() when a training size is given

    def reject(self, where: str, why: str) -> None:
        """A bad sample: refused (ConfigError naming it) unless bad samples are skipped."""
        problem = f"{where}: {why}"
        if not self.skip_bad:
            raise ConfigError(f"{problem}; fix or remove it, or set spec.data.skipBad: true to skip bad samples")
        self.skipped.append(problem)

    def images(self, samples: Sequence, rank: int = 0, world_size: int = 1,
               gather: Callable[[list], list[list]] = lambda mine: [mine],
               size: tuple[int, int] | None = None, by_area: bool = False) -> list:
        """The samples whose images are all readable. Each process checks every world_size-th
        sample; `gather` (a collective under several processes) shares the findings. With the
        training `size` (width, height), self.small counts the images smaller than it on a side, or
        in pixels `by_area` (aspect-ratio buckets resize each image to about that many pixels)."""
        mine = list(range(rank, len(samples), world_size))
        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            found = list(pool.map(lambda i: (i, *self._check(samples[i])), mine))
        shares = gather([(i, problem, sizes) for i, problem, sizes in found])
        bad = sorted((i, problem) for share in shares for i, problem, _ in share if problem)
        everything = [entry for share in shares for _, _, sizes in share for entry in sizes]
        share_found = getattr(self.check, "share", None)
        if share_found is not None:
            share_found(dict(everything))
        if size is not None:
            self.small = _small_images([(path, _size_of(found)) for path, found in everything], size, by_area)
        for _, problem in bad:
            where, _, why = problem.partition("\0")
            self.reject(where, why)
        dropped = {i for i, _ in bad}
        kept = [sample for i, sample in enumerate(samples) if i not in dropped]
        if not kept:
            raise ConfigError("spec.data.uri: no usable sample is left after skipping bad ones")
        return kept

    def _check(self, sample) -> tuple[str | None, list[tuple[Path, Any]]]:
        """(the sample's first problem as "path\0why" or None, what the check found of each readable file)."""
        sizes = []
        for path in image_paths(sample):
            problem, found = self.check(path)
            if problem:
                return f"{describe(path)}\0{problem}", sizes
            sizes.append((path, found))
        return None, sizes


def _small_images(sizes: list[tuple[Path, tuple[int, int]]], size: tuple[int, int],
                  by_area: bool) -> SmallImages | None:
    def smaller(w: int, h: int) -> bool:
        return w * h < size[0] * size[1] if by_area else (w < size[0] or h < size[1])

    small = [(path, (w, h)) for path, (w, h) in sizes if smaller(w, h)]
    if not small:
        return None
    path, smallest = min(small, key=lambda entry: (entry[1][0] * entry[1][1], str(entry[0])))
    return SmallImages(len(small), len(sizes), smallest, path)
