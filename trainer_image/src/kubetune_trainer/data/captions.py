"""The captions layout: images plus metadata.jsonl lines of {"file_name": ..., "text": ...} (or a
metadata.csv with those columns), or, in a folder without either, each image with its caption in
NAME.txt beside it (data.caption_files).

The metadata's keys are spec.data.imageColumn and captionColumn (file_name and text by default, the
Hugging Face image-folder convention, which takes metadata.csv as it takes metadata.jsonl). An
image's name is relative to the metadata's folder, or to an images/ folder beside it (the layout of
the SDXL LoRA guide's data sets).
"""
from __future__ import annotations

import csv
import io
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_api.spec_data import data_columns
from kubetune_trainer.data.caption_files import read_caption_files
from kubetune_trainer.data.data_files import data_file, not_text
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.layout_parts import Layout
from kubetune_trainer.data.records import Stored
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.tiny_drawing import COLOURS, SHAPES, draw_shape
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, confined
from kubetune_trainer.storage.stream import IMAGE_SUFFIXES, NotARegularFile, regular_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptionedImage:
    path: Path
    caption: str


IMAGES_FOLDER = "images"


def read_captions(root: Path, screen: Screen, image_column: str = "file_name",
                  caption_column: str = "text", folder: str = IMAGES_FOLDER,
                  layout: str = "captions", suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> list[CaptionedImage]:
    """Read metadata.jsonl (or metadata.csv); name the file and line of anything wrong (or skip it:
    screen). A file is looked for beside the metadata, then in `folder` (the video-captions layout
    reads clips the same way, from videos/). Without either, every file of `suffixes` with its NAME.txt."""
    keys = f'{{"{image_column}": ..., "{caption_column}": ...}}'
    what = "images" if folder == IMAGES_FOLDER else "clips"
    jsonl, table = data_file(root, "metadata.jsonl"), data_file(root, "metadata.csv")
    if jsonl and table:
        raise ConfigError(f"spec.data.uri: {root} has both metadata.jsonl and metadata.csv; keep the one that "
                          "describes the data set")
    if jsonl is None and table is None:
        return _from_caption_files(root, screen, suffixes, what, layout, keys)
    records = _jsonl_records(jsonl, screen, keys) if jsonl else _csv_records(table, (image_column, caption_column))
    samples = []
    for where, record in records:
        try:
            file_name, caption = record[image_column], record[caption_column]
        except KeyError as err:
            screen.reject(where, f"no key {err} (expected {keys}; spec.data.imageColumn and captionColumn "
                                 f"name other keys: this line has {', '.join(map(repr, record)) or 'none'})")
            continue
        except TypeError as err:
            screen.reject(where, f"expected {keys} ({err})")
            continue
        if not isinstance(file_name, str) or not isinstance(caption, str):
            screen.reject(where, f"{image_column} and {caption_column} must be strings (got "
                                 f"{type(file_name).__name__}, {type(caption).__name__})")
            continue
        if problem := not_text(caption, caption_column) or not_text(file_name, image_column):
            screen.reject(where, problem)
            continue
        try:
            path = _image_path(root, file_name, image_column, folder)
        except NotARegularFile as err:
            screen.reject(where, f"{file_name} {err}")
            continue
        except UnsafePath as err:
            screen.reject(where, str(err))
            continue
        if path is None:
            screen.reject(where, f"{file_name} does not exist in {root} nor in {root / folder}")
            continue
        samples.append(CaptionedImage(path, caption))
    if not samples:
        raise ConfigError(f"{jsonl or table} lists no usable {what}")
    return samples


def loose_samples(root: Path) -> list[tuple[Path, str, str, tuple[Path, ...]]]:
    """The data set as data.restore_data stores it again: (image, its name, caption, no controls) each."""
    return [(s.path, s.path.relative_to(root).as_posix(), s.caption, ()) for s in read_captions(root, Screen(skip_bad=False))]


def _jsonl_records(metadata: Path, screen: Screen, keys: str) -> Iterator[tuple[str, object]]:
    """("FILE:LINE", the line's JSON value) of each line that is not blank; a line that is not UTF-8
    or not JSON goes to the screen."""
    for number, line in enumerate(metadata.read_bytes().splitlines(), start=1):
        where = f"{metadata}:{number}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            screen.reject(where, f"not UTF-8 text (byte {err.start}); save metadata.jsonl as UTF-8")
            continue
        if not text.strip():
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as err:
            screen.reject(where, f"expected {keys} ({err})")


def _csv_records(metadata: Path, columns: tuple[str, str]) -> Iterator[tuple[str, dict]]:
    """("FILE:LINE", the row by its header's names) of each row of metadata.csv (Hugging Face's
    image-folder takes it as it takes metadata.jsonl; Excel writes a byte-order mark, dropped). A
    file that is not UTF-8 or lacks a named column is refused whole: no row of it can be read."""
    try:
        text = metadata.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{metadata}: not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    rows = csv.DictReader(io.StringIO(text, newline=""))
    header = rows.fieldnames or []
    for column, field in zip(columns, ("imageColumn", "captionColumn")):
        if column not in header:
            raise ConfigError(f"{metadata}: no column {column!r} (spec.data.{field}); its header has "
                              f"{', '.join(map(repr, header)) or 'no columns'}: name the right one in "
                              f"spec.data.{field}")
    try:
        for row in rows:
            yield f"{metadata}:{rows.line_num}", row
    except csv.Error as err:  # a field over the csv module's limit (131,072 characters)
        raise ConfigError(f"{metadata}: not readable as CSV after line {rows.line_num} ({err})") from None


def _from_caption_files(root: Path, screen: Screen, suffixes: tuple[str, ...], what: str, layout: str,
                        keys: str) -> list[CaptionedImage]:
    if not root.is_dir():
        raise FileNotFoundError(f"spec.data.uri: {root} is not a directory")
    samples = [CaptionedImage(path, caption) for path, caption in read_caption_files(root, screen, suffixes, what)]
    if not samples:
        raise ConfigError(
            f"spec.data.uri: {root} has no metadata.jsonl or metadata.csv and no {what} ({', '.join(suffixes)}) "
            f"with a caption NAME.txt beside them; the {layout} layout needs {what} plus metadata.jsonl lines of "
            f"{keys}, or each of them with its NAME.txt")
    log.info("%s has no metadata.jsonl or metadata.csv: %d %s captioned by their NAME.txt files", root,
             len(samples), what)
    return samples


def _image_path(root: Path, file_name: str, field: str, folder: str = IMAGES_FOLDER) -> Path | None:
    """The file `file_name` names: beside metadata.jsonl, else in its `folder` (None: neither)."""
    path = confined(root, file_name, field)
    if not path.exists():
        path = confined(root, f"{folder}/{file_name}", field)  # confined to root: the folder may be a link
    if not path.exists():
        return None
    regular_file(path)  # a FIFO or a device is named (reading it would block or never end)
    return path


class CaptionsDataset(KeyedDataset):
    def __init__(self, samples: list[CaptionedImage], transform: ImageTransform, caption_dropout: float,
                 seed: int, bucketing: bool = False):
        super().__init__(samples, [s.path for s in samples], transform, seed, bucketing)
        self.caption_dropout = caption_dropout

    def __getitem__(self, key: tuple[int, int]) -> dict:
        rng = self.rng(key)
        sample = self.samples[key[1]]
        pixels, crop = self.load_image(sample.path, key[1], rng)
        caption = "" if rng.random() < self.caption_dropout else sample.caption
        return {"pixel_values": pixels, "caption": caption, "full_caption": sample.caption, "crop": crop}


def collate(items: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "captions": [item["caption"] for item in items],
        "full_captions": [item["full_caption"] for item in items],  # before dropout: a cache variant
        "crops": [item["crop"] for item in items],
    }


# ---- the layout's parts (kubetune_api.data_layouts' row for it says what it is) ----

def read(spec: TrainingJobSpec, screen: Screen) -> list:
    image_column, caption_column, *_ = data_columns(spec.data)
    return read_captions(Path(spec.data.uri), screen, image_column, caption_column)


def dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    data = spec.data
    return CaptionsDataset(samples, transform, data.caption_dropout if training else 0.0,
                                    spec.training.seed, data.bucketing)


def from_stored(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    samples = []
    for record in records:
        if not isinstance(record.caption, str):
            screen.reject(record.where, f"its caption is {type(record.caption).__name__}, not text; give every "
                                        "sample a caption (spec.data.captionColumn names where it is)")
            continue
        samples.append(CaptionedImage(record.image, record.caption))
    return samples


def write_tiny(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0) -> Path:
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


LAYOUT = Layout(read, dataset, collate, write_tiny, from_stored=from_stored, loose=loose_samples)
