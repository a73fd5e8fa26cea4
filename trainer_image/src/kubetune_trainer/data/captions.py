"""The captions layout: images plus metadata.jsonl lines of {"file_name": ..., "text": ...}."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.errors import ConfigError


@dataclass(frozen=True)
class CaptionedImage:
    path: Path
    caption: str


def read_captions(root: Path) -> list[CaptionedImage]:
    """Read metadata.jsonl; name the file and line of anything wrong."""
    metadata = root / "metadata.jsonl"
    if not metadata.is_file():
        raise FileNotFoundError(
            f"spec.data.uri: {root} has no metadata.jsonl; the captions layout needs images plus "
            'metadata.jsonl lines of {"file_name": ..., "text": ...}'
        )
    samples = []
    for number, line in enumerate(metadata.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            sample = CaptionedImage(root / record["file_name"], str(record["text"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{metadata}:{number}: expected {{\"file_name\": ..., \"text\": ...}} ({err})") from None
        if not sample.path.is_file():
            raise FileNotFoundError(f"{metadata}:{number}: {sample.path.name} does not exist in {root}")
        samples.append(sample)
    if not samples:
        raise ConfigError(f"{metadata} lists no images")
    return samples


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
        return {"pixel_values": pixels, "caption": caption, "crop": crop}


def collate(items: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "captions": [item["caption"] for item in items],
        "crops": [item["crop"] for item in items],
    }
