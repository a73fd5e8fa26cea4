"""The edit-pairs layout: control_images/NAME.* (before), training_images/NAME.png (after) + NAME.txt
(the instruction that turns one into the other)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, inside

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


@dataclass(frozen=True)
class EditPair:
    control: Path
    target: Path
    instruction: str


def read_edit_pairs(root: Path, screen: Screen) -> list[EditPair]:
    """Pair every training image with its control image and instruction; name what is missing."""
    controls_dir, targets_dir = root / "control_images", root / "training_images"
    for folder in (controls_dir, targets_dir):
        if not folder.is_dir():
            raise FileNotFoundError(f"spec.data.uri: {root} has no {folder.name}/; the edit-pairs layout "
                                    "needs control_images/NAME.jpg and training_images/NAME.png + NAME.txt")
    controls = {p.stem: p for p in controls_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES}
    pairs = []
    for target in sorted(p for p in targets_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
        prompt = target.with_suffix(".txt")
        if target.stem not in controls:
            screen.reject(str(target), f"no control image control_images/{target.stem}.* for it")
            continue
        try:
            for path in (target, prompt, controls[target.stem]):
                inside(root, path, "data file")
            instruction = prompt.read_bytes().decode("utf-8").strip()
        except FileNotFoundError:
            screen.reject(str(target), f"no instruction {prompt.name} next to it")
            continue
        except UnicodeDecodeError as err:
            screen.reject(str(prompt), f"not UTF-8 text (byte {err.start})")
            continue
        except UnsafePath as err:
            screen.reject(str(target), str(err))
            continue
        if not instruction:
            screen.reject(str(prompt), "is empty: an edit pair needs its instruction")
            continue
        pairs.append(EditPair(controls[target.stem], target, instruction))
    if not pairs:
        raise ConfigError(f"spec.data.uri: {targets_dir} holds no usable pairs")
    return pairs


class EditPairsDataset(KeyedDataset):
    """Control and target get the same crop and flip; dropouts blank the instruction or the control."""

    def __init__(self, samples: list[EditPair], transform: ImageTransform, caption_dropout: float,
                 control_dropout: float, seed: int, bucketing: bool = False):
        super().__init__(samples, [s.target for s in samples], transform, seed, bucketing)
        self.caption_dropout = caption_dropout
        self.control_dropout = control_dropout

    def __getitem__(self, key: tuple[int, int]) -> dict:
        rng = self.rng(key)
        pair = self.samples[key[1]]
        flip = self.transform.random_flip and rng.random() < 0.5
        state = rng.getstate()
        target, crop = self.load_image(pair.target, key[1], rng, flip)
        rng.setstate(state)  # the same random crop for the control image
        control, _ = self.load_image(pair.control, key[1], rng, flip)
        if rng.random() < self.control_dropout:
            control = torch.zeros_like(control)  # mid-grey: "edit nothing in particular"
        instruction = "" if rng.random() < self.caption_dropout else pair.instruction
        return {"pixel_values": target, "control_values": control, "caption": instruction,
                "full_caption": pair.instruction, "crop": crop}


def collate(items: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "control_values": torch.stack([item["control_values"] for item in items]),
        "captions": [item["caption"] for item in items],
        "full_captions": [item["full_caption"] for item in items],  # before dropout: a cache variant
        "crops": [item["crop"] for item in items],
    }
