"""The pmg layout: data.json, a list of {"user_id", "history": [texts], "target_image", "target_caption"}."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.errors import ConfigError


@dataclass(frozen=True)
class UserSample:
    user_id: str
    history: tuple[str, ...]
    image: Path
    caption: str


def read_pmg(root: Path) -> list[UserSample]:
    path = root / "data.json"
    if not path.is_file():
        raise FileNotFoundError(f"spec.data.uri: {root} has no data.json; the pmg layout needs a list of "
                                '{"user_id", "history": [...], "target_image", "target_caption"}')
    try:
        records = json.loads(path.read_text())
        samples = [UserSample(str(r["user_id"]), tuple(str(h) for h in r["history"]), root / r["target_image"],
                              str(r["target_caption"])) for r in records]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"{path}: expected a list of {{user_id, history, target_image, target_caption}} "
                          f"({err!r})") from None
    for number, sample in enumerate(samples):
        if not sample.image.is_file():
            raise FileNotFoundError(f"{path}[{number}]: target_image {sample.image} does not exist")
    if not samples:
        raise ConfigError(f"{path} lists no samples")
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
