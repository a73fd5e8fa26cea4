"""The pmg layout: JSON lists of user records under spec.data.uri (spec.pmg.trainJson, valJson).

A record is either kubetune's own {"user_id", "history": [texts], "target_image", "target_caption"}
or the PMG guide's processed form (processed_dataset/{train,val}.json of FLICKR, POG, SER):
{"user_id" or "worker_id", "history_items_info": [{"caption", ...}], "target_item_info":
{"caption", "image_path"}}, read as is. Image paths are relative to spec.data.uri.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.data_files import data_file, not_text
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.layout_parts import Layout
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.tiny_drawing import COLOURS, SHAPES, draw_shape
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, confined

FORMS = ('{user_id, history: [texts], target_image, target_caption} or the PMG guide\'s '
         '{user_id or worker_id, history_items_info: [{caption}], target_item_info: {caption, image_path}}')


@dataclass(frozen=True)
class UserSample:
    user_id: str
    history: tuple[str, ...]
    image: Path
    caption: str


def _strings(value, what: str) -> None:
    if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
        raise TypeError(f"{what} must be text")
    for text in [value] if isinstance(value, str) else value:
        if problem := not_text(text, what):
            raise TypeError(problem)


def parse_record(record, root: Path) -> UserSample:
    """One record of either form; KeyError, TypeError or UnsafePath name what is wrong."""
    if not isinstance(record, dict):
        raise TypeError(f"a record is an object, not a {type(record).__name__}")
    if "history_items_info" in record:  # the guide's processed form
        items, target = record["history_items_info"], record["target_item_info"]
        if not (isinstance(items, list) and all(isinstance(i, dict) for i in items) and isinstance(target, dict)):
            raise TypeError("history_items_info must be a list of objects, target_item_info an object")
        history = [item["caption"] for item in items if item.get("caption")]
        user, image, caption = record.get("user_id", record.get("worker_id")), target["image_path"], target["caption"]
        if user is None:
            raise KeyError("user_id or worker_id")
        where = "target_item_info.image_path"
    else:
        history, user = record["history"], record["user_id"]
        image, caption, where = record["target_image"], record["target_caption"], "target_image"
    for value, what in ((history, "history"), (image, where), (caption, "the target caption")):
        _strings(value, what)
    if not isinstance(history, list):
        raise TypeError("history must be a list of texts")
    return UserSample(str(user), tuple(history), confined(root, image, where), caption)


def read_pmg(root: Path, screen: Screen, file_name: str = "data.json") -> list[UserSample]:
    path = data_file(root, file_name)
    if path is None:
        raise FileNotFoundError(f"spec.data.uri: {root} has no {file_name} (spec.pmg.trainJson / valJson); the pmg "
                                f"layout needs a JSON list of {FORMS}")
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(records, list):
            raise TypeError(f"the top level is a {type(records).__name__}")
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
        raise ConfigError(f"{path}: expected a UTF-8 JSON list of {FORMS} ({err})") from None
    samples = []
    for number, record in enumerate(records):
        where = f"{path}[{number}]"
        try:
            sample = parse_record(record, root)
        except (KeyError, TypeError) as err:
            screen.reject(where, f"expected {FORMS} ({type(err).__name__}: {err})")
            continue
        except UnsafePath as err:
            screen.reject(where, f"{err} (write image paths relative to spec.data.uri)")
            continue
        if not sample.image.is_file():
            screen.reject(where, f"{sample.image} does not exist")
            continue
        samples.append(sample)
    if not samples:
        raise ConfigError(f"{path} lists no usable samples")
    return samples


def history_text(sample: UserSample) -> str:
    """What the language model reads: the items the user engaged with, one per line."""
    return "\n".join(sample.history)


class PmgDataset(KeyedDataset):
    def __init__(self, samples: list[UserSample], transform: ImageTransform, seed: int):
        super().__init__(samples, [s.image for s in samples], transform, seed, bucketing=False)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        sample = self.samples[key[1]]
        pixels, _ = self.load_image(sample.image, key[1], self.rng(key))
        return {"pixel_values": pixels, "history": history_text(sample), "caption": sample.caption}


def collate(items: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "histories": [item["history"] for item in items],
        "captions": [item["caption"] for item in items],
        "full_captions": [item["caption"] for item in items],  # PMG drops no caption: always the full one
    }


# ---- the layout's parts (kubetune_api.data_layouts' row for it says what it is) ----

def read(spec: TrainingJobSpec, screen: Screen) -> list:
    return read_pmg(Path(spec.data.uri), screen, spec.pmg_options.train_json)


def held_out(spec: TrainingJobSpec, screen: Screen) -> list | None:
    """spec.valJson, the PMG guide's val split, when given."""
    val_json = spec.pmg_options.val_json
    return None if val_json is None else read_pmg(Path(spec.data.uri), screen, val_json)


def dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    return PmgDataset(samples, transform, spec.training.seed)


def write_tiny(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0) -> Path:
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


LAYOUT = Layout(read, dataset, collate, write_tiny, held_out=held_out)
