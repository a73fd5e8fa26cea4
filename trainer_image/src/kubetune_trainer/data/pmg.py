"""The pmg layout: data.json, a list of {"user_id", "history": [texts], "target_image", "target_caption"}."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, confined


@dataclass(frozen=True)
class UserSample:
    user_id: str
    history: tuple[str, ...]
    image: Path
    caption: str


def read_pmg(root: Path, screen: Screen) -> list[UserSample]:
    path = root / "data.json"
    if not path.is_file():
        raise FileNotFoundError(f"spec.data.uri: {root} has no data.json; the pmg layout needs a list of "
                                '{"user_id", "history": [...], "target_image", "target_caption"}')
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(records, list):
            raise TypeError(f"the top level is a {type(records).__name__}")
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
        raise ConfigError(f"{path}: expected a UTF-8 JSON list of {{user_id, history, target_image, "
                          f"target_caption}} ({err})") from None
    samples = []
    for number, record in enumerate(records):
        where = f"{path}[{number}]"
        try:
            history, image, caption = record["history"], record["target_image"], record["target_caption"]
            if not (isinstance(history, list) and all(isinstance(h, str) for h in history)
                    and isinstance(image, str) and isinstance(caption, str)):
                raise TypeError("history must be a list of strings, target_image and target_caption strings")
            sample = UserSample(str(record["user_id"]), tuple(history), confined(root, image, "target_image"), caption)
        except (KeyError, TypeError) as err:
            screen.reject(where, f"expected {{user_id, history, target_image, target_caption}} ({err})")
            continue
        except UnsafePath as err:
            screen.reject(where, str(err))
            continue
        if not sample.image.is_file():
            screen.reject(where, f"target_image {sample.image} does not exist")
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
    }
