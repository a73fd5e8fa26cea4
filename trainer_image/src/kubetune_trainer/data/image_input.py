"""How every image the trainer reads becomes RGB pixels: one set of rules for captions, edit pairs
(their control images too, in validation and `kubetune generate --control`), image folders, pmg,
and image bytes inside parquet files and shards.

- Bounded before decoding: `Image.open` reads only the header, so the size is checked there. An
  image over MAX_PIXELS, or longer than MAX_ASPECT_RATIO times its shorter side, is refused naming
  it: a 1 x 20,000,000 strip is small on disk, but resizing it to cover a 512-pixel square asks for
  ~10^10 pixels.
- Orientation: the EXIF Orientation tag is applied (a phone's portrait photo trains upright), and
  sizes read from the header (aspect-ratio buckets) are the oriented ones.
- Modes, converted to 8-bit RGB:
  * 16-bit grey (I;16, I;16B, I;16L, I;16N) and 32-bit integer grey (I, read as 16-bit values, as
    Pillow opens 16-bit PNGs on some versions) are scaled by 255/65535; Pillow's own conversion
    clips them, turning all but the darkest pixels white.
  * floating-point grey (F) is read as 0..1 and scaled by 255 (values outside are clipped).
  * alpha (RGBA, LA, PA, a palette or grey image with a transparent colour) is composited over
    BACKGROUND, opaque white: transparent pixels train as white, not as whatever colour the file
    happens to store under them.
  * CMYK, palette (P), YCbCr, 1-bit and grey: Pillow's conversion; an embedded ICC profile is not
    applied (CMYK is converted by Pillow's formula, without colour management).
  * any other mode (LAB, HSV, ...) is refused naming it.
"""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageOps

MAX_PIXELS = Image.MAX_IMAGE_PIXELS  # Pillow's decompression-bomb warning threshold (89,478,485)
MAX_ASPECT_RATIO = 16                # a 16:1 panorama trains; a longer strip is refused
BACKGROUND = (255, 255, 255)         # what alpha is composited over

SIXTEEN_BIT_GREY = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
CONVERTIBLE = {"1", "L", "P", "RGB", "RGBX", "CMYK", "YCbCr"}
ORIENTATION_TAG = 0x0112
SWAPS_SIDES = {5, 6, 7, 8}  # orientations that turn the image a quarter


class ImageRefused(ValueError):
    """An image the trainer will not decode (its size or mode); the message says why, not where."""


def check_bounds(size: tuple[int, int]) -> None:
    """Refuse a (width, height) over MAX_PIXELS or MAX_ASPECT_RATIO (both known from the header)."""
    width, height = size
    if width < 1 or height < 1:
        raise ImageRefused(f"is {width}x{height} pixels: an image has at least one pixel on each side")
    if width * height > MAX_PIXELS:
        raise ImageRefused(f"is {width}x{height} pixels, larger than {MAX_PIXELS} pixels (a decompression bomb?); "
                           "downscale it")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageRefused(f"is {width}x{height} pixels, longer than {MAX_ASPECT_RATIO} times its shorter side "
                           f"(at most {MAX_ASPECT_RATIO}:1 is trained); crop it")


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) as the image will be trained: sides swapped when its EXIF orientation turns
    it a quarter. Read from what the header gave (no decoding: PNG keeps EXIF after the pixels at
    times, and such a tag is applied when decoding but not seen here)."""
    raw = image.info.get("exif")
    if not raw:
        return image.size
    exif = Image.Exif()
    try:
        exif.load(raw)
    except (OSError, SyntaxError, ValueError, KeyError, TypeError):
        return image.size  # unreadable EXIF: decoding will not turn it either
    width, height = image.size
    return (height, width) if exif.get(ORIENTATION_TAG) in SWAPS_SIDES else (width, height)


def to_rgb(image: Image.Image) -> Image.Image:
    """The image decoded, bounded, oriented and converted to 8-bit RGB by the rules above."""
    check_bounds(image.size)
    if image.mode not in CONVERTIBLE | SIXTEEN_BIT_GREY | {"F"} and not has_alpha(image):
        raise ImageRefused(f"has mode {image.mode}, which kubetune does not convert to RGB; save it as RGB "
                           "(PNG or JPEG)")
    image.load()
    if image.getexif().get(ORIENTATION_TAG, 1) != 1:  # exif_transpose copies even an upright image
        image = ImageOps.exif_transpose(image)
    if image.mode in SIXTEEN_BIT_GREY:
        image = _scaled(np.asarray(image, dtype=np.float64) * (255 / 65535))
    elif image.mode == "F":
        image = _scaled(np.asarray(image, dtype=np.float64) * 255)
    if has_alpha(image):
        flat = Image.new("RGBA", image.size, (*BACKGROUND, 255))
        flat.alpha_composite(image.convert("RGBA"))
        return flat.convert("RGB")
    return image.convert("RGB")


def has_alpha(image: Image.Image) -> bool:
    return image.mode in {"RGBA", "LA", "PA", "RGBa", "La"} or (
        image.mode in {"P", "L", "RGB", "1"} and "transparency" in image.info)


def _scaled(values: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L")
