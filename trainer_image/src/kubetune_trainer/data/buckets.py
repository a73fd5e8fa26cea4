"""Aspect-ratio buckets: a few image shapes of about resolution^2 pixels; each image goes to the nearest.

Training on buckets keeps a portrait a portrait instead of cropping it square; the sampler then
batches images of one bucket only, so a batch stacks into one tensor.
"""
from __future__ import annotations

import math
from pathlib import Path

from kubetune_trainer.storage.stream import image_size

# Width:height ratios from 1:2 to 2:1; the usual set of the SDXL and FLUX trainers, give or take.
ASPECT_RATIOS = (1 / 2, 9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9, 2.0)


def bucket_step(resolution: int) -> int:
    """Sides are multiples of 64 at real sizes (VAE x UNet downsampling); tiny test sizes use 16, the
    VAE's 8 times the 2x2 latent patches FLUX and Qwen-Image pack (8 gave odd latent sides they refuse)."""
    return 64 if resolution >= 256 else 16


def bucket_sizes(resolution: int) -> list[tuple[int, int]]:
    """(width, height) of each bucket: the ratio's shape with resolution^2 area, rounded to the step."""
    step = bucket_step(resolution)
    sizes = []
    for ratio in ASPECT_RATIOS:
        width = max(step, round(resolution * math.sqrt(ratio) / step) * step)
        height = max(step, round(resolution / math.sqrt(ratio) / step) * step)
        if (width, height) not in sizes:
            sizes.append((width, height))
    return sizes


def nearest_bucket(width: int, height: int, sizes: list[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is closest (in log space: 2:1 is as far as 1:2)."""
    ratio = math.log(width / height)
    return min(range(len(sizes)), key=lambda i: abs(math.log(sizes[i][0] / sizes[i][1]) - ratio))


def assign_buckets(paths: list[Path], resolution: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Each image's bucket (read from the file header only) and the bucket sizes."""
    return buckets_of_sizes([image_size(path) for path in paths], resolution)


def buckets_of_sizes(sizes: list[tuple[int, int]], resolution: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Each (width, height)'s bucket and the bucket sizes (a video clip's size is its frames')."""
    buckets = bucket_sizes(resolution)
    return [nearest_bucket(width, height, buckets) for width, height in sizes], buckets
