"""What the tiny data sets of every layout draw (their writers: each layout module's write_tiny): coloured
shapes on a background, captioned with what they show, so a model has something learnable and captions
differ per image.
"""
from __future__ import annotations

import random

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle")


def draw_shape(colour: str, shape: str, size: int, rng: random.Random) -> Image.Image:
    background = tuple(rng.randrange(0, 80) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    margin = rng.randrange(size // 8, size // 4)
    box = (margin, margin, size - margin, size - margin)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return image
