"""Image preprocessing: resize, crop, flip, scale to [-1, 1]; randomness from a given RNG."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class Crop:
    """Where the training pixels came from: SDXL is conditioned on both (height-first, as it expects)."""

    original_size: tuple[int, int]  # (height, width) before resizing
    top_left: tuple[int, int]       # (top, left) of the crop in the resized image


@dataclass(frozen=True)
class ImageTransform:
    size: int | tuple[int, int]  # the training size: a square's side, or (width, height)
    center_crop: bool = True
    random_flip: bool = False
    # A random crop chosen once per image rather than per epoch: with the embedding cache on, the
    # crop's latents are then reused every epoch (flips are cached both ways, see EmbeddingCache).
    crop_per_sample: bool = False

    @property
    def width_height(self) -> tuple[int, int]:
        return (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)

    @property
    def resolution(self) -> int:
        """The side of a square of the training size's area (what aspect-ratio buckets keep)."""
        width, height = self.width_height
        return round((width * height) ** 0.5)

    def __call__(self, image: Image.Image, rng: random.Random) -> torch.Tensor:
        return self.apply(image, rng)[0]

    def apply(self, image: Image.Image, rng: random.Random, size: tuple[int, int] | None = None,
              flip: bool | None = None, crop_rng: random.Random | None = None) -> tuple[torch.Tensor, Crop]:
        """Resize to cover `size` (width, height; default the training size), crop, maybe flip.

        `flip` forces the decision, so an edit pair's control and target images flip together;
        `crop_rng` draws the crop instead of `rng` (a per-image generator for crop_per_sample).
        """
        width, height = size or self.width_height
        original = (image.height, image.width)
        image = resize_to_cover(image, width, height)
        left, top = crop_origin(image.size, (width, height), self.center_crop, crop_rng or rng)
        image = image.crop((left, top, left + width, top + height))
        if flip is None:
            flip = self.random_flip and rng.random() < 0.5
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_tensor(image), Crop(original, (top, left))


def to_tensor(image: Image.Image) -> torch.Tensor:
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def resize_to_cover(image: Image.Image, width: int, height: int) -> Image.Image:
    """The smallest resize (aspect kept) that covers width x height."""
    size = cover_size(image.size, width, height)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


def cover_size(size: tuple[int, int], width: int, height: int) -> tuple[int, int]:
    """(width, height) of the smallest resize of `size` (aspect kept) that covers width x height."""
    scale = max(width / size[0], height / size[1])
    if scale == 1:
        return size
    return max(width, round(size[0] * scale)), max(height, round(size[1] * scale))


def resize_shorter_side(image: Image.Image, size: int) -> Image.Image:
    return resize_to_cover(image, size, size)


def crop_origin(image_size: tuple[int, int], crop_size: int | tuple[int, int], center: bool,
                rng: random.Random) -> tuple[int, int]:
    width, height = image_size
    crop_w, crop_h = (crop_size, crop_size) if isinstance(crop_size, int) else crop_size
    if center:
        return (width - crop_w) // 2, (height - crop_h) // 2
    return rng.randint(0, width - crop_w), rng.randint(0, height - crop_h)


def to_pil(pixels: torch.Tensor) -> Image.Image:
    """The inverse of to_tensor: a [-1, 1] CHW tensor back to an RGB image."""
    array = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(array)
