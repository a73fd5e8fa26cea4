"""Small generated data sets in each layout, for demos and tests (no data-set hub here).

Images are coloured shapes on a background, captioned with what they show, so a model has
something learnable and captions differ per image; video clips show such a shape moving.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

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


def write_captions_dataset(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0) -> Path:
    """The Hugging Face image-folder convention: images + metadata.jsonl of {file_name, text}."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        name = f"{i:04d}.png"
        draw_shape(colour, shape, size, rng).save(out_dir / name)
        lines.append(json.dumps({"file_name": name, "text": f"a {colour} {shape}"}))
    (out_dir / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return out_dir


def write_edit_pairs_dataset(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0,
                             references: int | tuple[int, ...] = 1) -> Path:
    """control_images/NAME.jpg -> training_images/NAME.png, the instruction in training_images/NAME.txt.

    references: control images per sample (a tuple: per sample in turn). Several are
    control_images/NAME_0.jpg (the shape before) and NAME_1.jpg, ... (swatches of the colour it
    becomes), and the instruction names picture 2."""
    rng = random.Random(seed)
    counts = references if isinstance(references, tuple) else (references,)
    (out_dir / "control_images").mkdir(parents=True, exist_ok=True)
    (out_dir / "training_images").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        before, after = rng.sample(list(COLOURS), 2)
        shape = rng.choice(SHAPES)
        state = rng.getstate()
        several = counts[i % len(counts)] > 1
        before_image = draw_shape(before, shape, size, rng)
        rng.setstate(state)  # the same background and margin: only the colour changes
        draw_shape(after, shape, size, rng).save(out_dir / "training_images" / f"{i:04d}.png")
        if not several:
            before_image.save(out_dir / "control_images" / f"{i:04d}.jpg")
            (out_dir / "training_images" / f"{i:04d}.txt").write_text(f"make the {shape} {after}\n")
            continue
        before_image.save(out_dir / "control_images" / f"{i:04d}_0.jpg")
        for number in range(1, counts[i % len(counts)]):
            Image.new("RGB", (size, size), COLOURS[after]).save(out_dir / "control_images" / f"{i:04d}_{number}.jpg")
        (out_dir / "training_images" / f"{i:04d}.txt").write_text(
            f"make the {shape} of picture 1 the colour of picture 2 ({after})\n")
    return out_dir


def write_image_folder_dataset(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0) -> Path:
    """CLASS/NAME.png with the shape as the class (square, circle)."""
    rng = random.Random(seed)
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        (out_dir / shape).mkdir(parents=True, exist_ok=True)
        draw_shape(rng.choice(list(COLOURS)), shape, size, rng).save(out_dir / shape / f"{i:04d}.png")
    return out_dir


def write_pmg_dataset(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0) -> Path:
    """data.json of users whose history leans to one colour; their target image shows it."""
    rng = random.Random(seed)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(count):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        name = f"images/{i:04d}.png"
        draw_shape(colour, shape, size, rng).save(out_dir / name)
        history = [f"{colour} {rng.choice(['shirt', 'car', 'mug', 'poster'])}" for _ in range(3)]
        records.append({"user_id": f"user{i % 3}", "history": history, "target_image": name,
                        "target_caption": f"a {colour} {shape}"})
    (out_dir / "data.json").write_text(json.dumps(records, indent=1))
    return out_dir


def write_video_captions_dataset(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0,
                                 frames: int | tuple[int, ...] = 9, fps: int = 16) -> Path:
    """H.264 .mp4 clips (PyAV) + metadata.jsonl of {file_name, text}: a shape sliding left or right.

    frames: per clip (a tuple: per clip in turn). The sides are rounded up to even (4:2:0 chroma)."""
    import numpy as np

    from kubetune_trainer.data.video import write_clip

    rng = random.Random(seed)
    side = size + size % 2
    counts = frames if isinstance(frames, tuple) else (frames,)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        colour, shape, direction = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(("left", "right"))
        still = np.asarray(draw_shape(colour, shape, side, rng))
        length = counts[i % len(counts)]
        step = max(1, side // (2 * length)) * (1 if direction == "right" else -1)
        name = f"{i:04d}.mp4"
        write_clip(out_dir / name, [np.roll(still, step * t, axis=1) for t in range(length)], fps)
        lines.append(json.dumps({"file_name": name, "text": f"a {colour} {shape} moving {direction}"}))
    (out_dir / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return out_dir


WRITERS = {"captions": write_captions_dataset, "edit-pairs": write_edit_pairs_dataset,
           "image-folder": write_image_folder_dataset, "pmg": write_pmg_dataset,
           "video-captions": write_video_captions_dataset}


def write_tiny_data(layout: str, out_dir: Path, count: int = 8, size: int = 64, seed: int = 0, **options) -> Path:
    """options: the layout writer's own (edit-pairs: references; video-captions: frames, fps)."""
    if layout not in WRITERS:
        raise ValueError(f"no tiny data for layout {layout!r}; available: {', '.join(WRITERS)}")
    return WRITERS[layout](out_dir, count=count, size=size, seed=seed, **options)
