"""The captions layout as people lay it out: other keys than file_name/text (spec.data.imageColumn,
captionColumn), images in an images/ folder beside metadata.jsonl (the SDXL LoRA guide's data sets),
and a warning for images smaller than the training size."""
from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from kubetune_trainer.data.captions import read_captions
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError


def write_set(root, names_and_sizes, keys=("file_name", "text"), folder="images"):
    (root / folder).mkdir(parents=True, exist_ok=True)
    lines = []
    for name, size in names_and_sizes:
        Image.new("RGB", size, "red").save(root / folder / name)
        lines.append(json.dumps({keys[0]: name, keys[1]: f"a photo of {name}"}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_the_sdxl_guides_layout_with_its_own_keys_reads(tmp_path):
    root = write_set(tmp_path, [("a.png", (64, 64)), ("b.png", (64, 64))], keys=("image", "prompt"))
    samples = read_captions(root, Screen(skip_bad=False), image_column="image", caption_column="prompt")
    assert [(s.path, s.caption) for s in samples] == [(root / "images" / "a.png", "a photo of a.png"),
                                                       (root / "images" / "b.png", "a photo of b.png")]


def test_a_key_the_lines_do_not_have_is_named_with_the_keys_they_have(tmp_path):
    root = write_set(tmp_path, [("a.png", (64, 64))], keys=("image", "prompt"))
    with pytest.raises(ConfigError, match=r"metadata.jsonl:1: no key 'file_name' \(expected \{\"file_name\": \.\.\., "
                                          r"\"text\": \.\.\.\}; spec.data.imageColumn and captionColumn name other "
                                          r"keys: this line has 'image', 'prompt'\)"):
        read_captions(root, Screen(skip_bad=False))


def test_an_images_folder_that_links_outside_the_data_set_is_refused(tmp_path):
    outside = write_set(tmp_path / "elsewhere", [("a.png", (64, 64))])
    root = tmp_path / "data"
    root.mkdir()
    (root / "metadata.jsonl").write_text((outside / "metadata.jsonl").read_text())
    os.symlink(outside / "images", root / "images")
    with pytest.raises(ConfigError, match="leads outside .* through a symbolic link"):
        read_captions(root, Screen(skip_bad=False))


def test_images_smaller_than_the_training_size_are_counted_with_the_smallest_named(tmp_path):
    root = write_set(tmp_path, [("big.png", (64, 64)), ("wide.png", (80, 24)), ("tiny.png", (16, 16))])
    screen = Screen(skip_bad=False)
    samples = screen.images(read_captions(root, screen), size=(32, 32))
    assert len(samples) == 3, "small images still train (upscaled)"
    assert screen.small.warning((32, 32)) == (
        f"2 of 3 images are smaller than the training size 32x32 and will be upscaled; the smallest is 16x16 "
        f"({root / 'images' / 'tiny.png'}); lower spec.data.resolution or replace them for sharper results")
    screen.images(read_captions(root, screen), size=(32, 32), by_area=True)
    assert (screen.small.count, screen.small.smallest) == (1, (16, 16)), "buckets keep the pixel count, not the sides"
    screen.images(read_captions(root, screen), size=(16, 16))
    assert screen.small is None


def test_a_width_by_height_training_size_crops_and_samples_at_that_size(tiny_job, tmp_path):
    from PIL import Image as PILImage

    from tests.trainer.conftest import run_dir, run_trainer

    manifest = tiny_job(maxSteps=2)
    manifest["spec"]["data"]["resolution"] = [48, 32]  # [width, height], as the Qwen/Kontext guide writes it
    manifest["spec"]["validation"] = {"everySteps": 2, "prompts": ["a red circle"], "numInferenceSteps": 1}
    result = run_trainer(manifest, tmp_path)
    assert "8 of 8 images are smaller than the training size 48x32" in result.stderr, "32x32 data: narrower"
    [sample] = (run_dir(tmp_path / "out") / "samples" / "step-0000002").glob("0.png")
    assert PILImage.open(sample).size == (48, 32)
