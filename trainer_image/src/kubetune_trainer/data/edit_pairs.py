"""The edit-pairs layout: control_images/NAME.* (before), training_images/NAME.png (after) + NAME.txt
(the instruction that turns one into the other).

A sample may have several control (reference) images, numbered from 0: control_images/NAME_0.png,
NAME_1.png, ... in that order (Qwen-Image-Edit-2509/2511 reads up to three: "picture 1", "picture 2"
...). How many a family takes is its row's `max_references` (kubetune_api.families); a sample with
more is refused (or skipped, spec.data.skipBad) before training, naming its files.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from kubetune_api.families import FAMILIES
from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.layout_parts import Layout
from kubetune_trainer.data.records import Stored
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.tiny_drawing import COLOURS, SHAPES, draw_shape
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, inside
from kubetune_trainer.storage.stream import NotARegularFile, regular_file

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
NUMBERED = re.compile(r"(.+)_(\d+)")  # NAME_0, NAME_1, ...: one of a sample's several control images


@dataclass(frozen=True)
class EditPair:
    controls: tuple[Path, ...]  # the reference images, in order (most families: exactly one)
    target: Path
    instruction: str


def read_edit_pairs(root: Path, screen: Screen, max_references: int = 1, family: str = "this family"
                    ) -> list[EditPair]:
    """Pair every training image with its control image(s) and instruction; name what is missing,
    and every sample with more control images than `max_references` (what `family` takes)."""
    controls_dir, targets_dir = root / "control_images", root / "training_images"
    for folder in (controls_dir, targets_dir):
        if not folder.is_dir():
            raise FileNotFoundError(f"spec.data.uri: {root} has no {folder.name}/; the edit-pairs layout "
                                    "needs control_images/NAME.jpg and training_images/NAME.png + NAME.txt")
    controls = {p.stem: p for p in controls_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES}
    numbered: dict[str, list[tuple[int, Path]]] = {}
    for stem, path in controls.items():
        if match := NUMBERED.fullmatch(stem):
            numbered.setdefault(match[1], []).append((int(match[2]), path))
    targets = sorted(p for p in targets_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    target_stems = {p.stem for p in targets}
    pairs = []
    for target in targets:
        prompt = target.with_suffix(".txt")
        references = _references(target.stem, controls, numbered, target_stems)
        if isinstance(references, str):
            screen.reject(str(target), references)
            continue
        if len(references) > max_references:
            names = ", ".join(f"control_images/{p.name}" for p in references)
            screen.reject(str(target), f"has {len(references)} control images ({names}); spec.model.family "
                                       f"{family} takes {_at_most(max_references)} per sample")
            continue
        try:
            for path in (target, prompt, *references):
                inside(root, path, "data file")
            instruction = regular_file(prompt).read_bytes().decode("utf-8").strip()
        except NotARegularFile as err:
            screen.reject(str(prompt), str(err))
            continue
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
        pairs.append(EditPair(references, target, instruction))
    if not pairs:
        raise ConfigError(f"spec.data.uri: {targets_dir} holds no usable pairs")
    return pairs


def loose_samples(root: Path) -> list[tuple[Path, str, str, tuple[Path, ...]]]:
    """The data set as data.restore_data stores it again: (target, its name, instruction, controls) each."""
    return [(s.target, s.target.relative_to(root).as_posix(), s.instruction, s.controls)
            for s in read_edit_pairs(root, Screen(skip_bad=False), max_references=100)]


def _references(name: str, controls: dict[str, Path], numbered: dict[str, list[tuple[int, Path]]],
                target_stems: set[str]) -> tuple[Path, ...] | str:
    """NAME's control images (control_images/NAME.*, else NAME_0.*, NAME_1.*, ... by number), or why not."""
    # NAME_0.* is the control image of a training image NAME_0 where there is one.
    several = tuple(path for _, path in sorted(numbered.get(name, [])) if path.stem not in target_stems)
    if name in controls:
        if several:
            return (f"has both control_images/{controls[name].name} and control_images/{several[0].name}: "
                    f"name one control image {name}.*, or several {name}_0.*, {name}_1.*, ...")
        return (controls[name],)
    if several:
        return several
    return f"no control image control_images/{name}.* (or {name}_0.*, {name}_1.*, ...) for it"


def _at_most(count: int) -> str:
    return "one control image (control_images/NAME.*)" if count == 1 else f"at most {count} control images"


class EditPairsDataset(KeyedDataset):
    """Control(s) and target get the same crop and flip; dropouts blank the instruction, or every
    control image of the sample at once. Samples are batched with others of as many control images."""

    def __init__(self, samples: list[EditPair], transform: ImageTransform, caption_dropout: float,
                 control_dropout: float, seed: int, bucketing: bool = False):
        super().__init__(samples, [s.target for s in samples], transform, seed, bucketing,
                         kinds=[len(s.controls) for s in samples])
        self.caption_dropout = caption_dropout
        self.control_dropout = control_dropout

    def __getitem__(self, key: tuple[int, int]) -> dict:
        rng = self.rng(key)
        pair = self.samples[key[1]]
        flip = self.transform.random_flip and rng.random() < 0.5
        state = rng.getstate()
        target, crop = self.load_image(pair.target, key[1], rng, flip)
        controls = []
        for path in pair.controls:
            rng.setstate(state)  # the same random crop for each control image
            controls.append(self.load_image(path, key[1], rng, flip)[0])
        control = torch.stack(controls)
        if rng.random() < self.control_dropout:
            control = torch.zeros_like(control)  # mid-grey: "edit nothing in particular"
        instruction = "" if rng.random() < self.caption_dropout else pair.instruction
        return {"pixel_values": target, "control_values": control, "caption": instruction,
                "full_caption": pair.instruction, "crop": crop}


def collate(items: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        # [B, references, 3, H, W]: a batch's samples have as many control images (the sampler's groups)
        "control_values": torch.stack([item["control_values"] for item in items]),
        "captions": [item["caption"] for item in items],
        "full_captions": [item["full_caption"] for item in items],  # before dropout: a cache variant
        "crops": [item["crop"] for item in items],
    }


# ---- the layout's parts (kubetune_api.data_layouts' row for it says what it is) ----

def read(spec: TrainingJobSpec, screen: Screen) -> list:
    """How many control images a sample may have is the family's row's max_references."""
    family = spec.model.family
    return read_edit_pairs(Path(spec.data.uri), screen, FAMILIES[family].max_references, family)


def dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    data = spec.data
    return EditPairsDataset(samples, transform, data.caption_dropout if training else 0.0,
                                       data.control_dropout if training else 0.0, spec.training.seed, data.bucketing)


def from_stored(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    """Edit pairs: a target image, its control images (as many as the family's row allows) and a
    non-empty instruction, as loose edit pairs are checked (data.edit_pairs)."""
    family = spec.model.family
    most = FAMILIES[family].max_references
    pairs = []
    for record in records:
        if not record.controls:
            screen.reject(record.where, "has no control image (spec.data.controlColumn names where they are)")
        elif len(record.controls) > most:
            screen.reject(record.where, f"has {len(record.controls)} control images; spec.model.family {family} "
                                        f"takes at most {most}")
        elif not isinstance(record.caption, str) or not record.caption.strip():
            screen.reject(record.where, "has no instruction: an edit pair needs its instruction "
                                        "(spec.data.captionColumn names where it is)")
        else:
            pairs.append(EditPair(record.controls, record.image, record.caption.strip()))
    return pairs


def write_tiny(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0,
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


LAYOUT = Layout(read, dataset, collate, write_tiny, from_stored=from_stored, loose=loose_samples)
