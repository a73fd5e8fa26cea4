"""Bad samples are found before training, not at step 7 of 8: each is refused naming its file, or
skipped and counted when the job says `spec.data.skipBad: true`.

Readers report record-level problems (a broken metadata line, a caption that is not text, a file
name that leaves the data set) through `Screen.reject`; then every image is opened, verified and
fully decoded once (`image_problem`): truncated files, files that are not images, and images over
Pillow's decompression-bomb limit are caught here. Processes split the images between them and
share what they found, so every process keeps the same samples.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from kubetune_trainer.errors import ConfigError

CHECK_THREADS = 4  # decoding releases the GIL: a few threads keep the disk and the cores busy


def image_problem(path: Path) -> str | None:
    """Why an image cannot be trained on, or None when it can."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.verify()  # the container: chunks, checksums
            with Image.open(path) as image:
                image.load()  # the pixels: a truncated file fails here
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return f"is larger than {Image.MAX_IMAGE_PIXELS} pixels (a decompression bomb?)"
    except (OSError, SyntaxError, ValueError, Image.UnidentifiedImageError) as err:
        return f"cannot be read as an image ({type(err).__name__}: {err})"
    return None


def image_paths(sample) -> list[Path]:
    """The images a sample reads: its Path fields."""
    return [value for value in (getattr(sample, f.name) for f in dataclasses.fields(sample))
            if isinstance(value, Path)]


class Screen:
    def __init__(self, skip_bad: bool):
        self.skip_bad = skip_bad
        self.skipped: list[str] = []

    def reject(self, where: str, why: str) -> None:
        """A bad sample: refused (ConfigError naming it) unless bad samples are skipped."""
        problem = f"{where}: {why}"
        if not self.skip_bad:
            raise ConfigError(f"{problem}; fix or remove it, or set spec.data.skipBad: true to skip bad samples")
        self.skipped.append(problem)

    def images(self, samples: Sequence, rank: int = 0, world_size: int = 1,
               gather: Callable[[list], list[list]] = lambda mine: [mine]) -> list:
        """The samples whose images are all readable. Each process checks every world_size-th
        sample; `gather` (a collective under several processes) shares the findings."""
        mine = list(range(rank, len(samples), world_size))
        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            found = list(pool.map(lambda i: (i, self._first_problem(samples[i])), mine))
        bad = sorted((i, problem) for share in gather([(i, p) for i, p in found if p]) for i, problem in share)
        for _, problem in bad:
            where, _, why = problem.partition("\0")
            self.reject(where, why)
        dropped = {i for i, _ in bad}
        kept = [sample for i, sample in enumerate(samples) if i not in dropped]
        if not kept:
            raise ConfigError("spec.data.uri: no usable sample is left after skipping bad ones")
        return kept

    @staticmethod
    def _first_problem(sample) -> str | None:
        for path in image_paths(sample):
            problem = image_problem(path)
            if problem:
                return f"{path}\0{problem}"
        return None
