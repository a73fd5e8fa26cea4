"""Image preprocessing: resize, crop, flip, scale to [-1, 1]; randomness from a given RNG."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class ImageTransform:
    resolution: int
    center_crop: bool = True
    random_flip: bool = False

    def __call__(self, image: Image.Image, rng: random.Random) -> torch.Tensor:
        image = resize_shorter_side(image, self.resolution)
        left, top = crop_origin(image.size, self.resolution, self.center_crop, rng)
        image = image.crop((left, top, left + self.resolution, top + self.resolution))
        if self.random_flip and rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def resize_shorter_side(image: Image.Image, size: int) -> Image.Image:
    width, height = image.size
    scale = size / min(width, height)
    if scale == 1:
        return image
    return image.resize((max(size, round(width * scale)), max(size, round(height * scale))),
                        Image.Resampling.BICUBIC)


def crop_origin(image_size: tuple[int, int], size: int, center: bool, rng: random.Random) -> tuple[int, int]:
    width, height = image_size
    if center:
        return (width - size) // 2, (height - size) // 2
    return rng.randint(0, width - size), rng.randint(0, height - size)
