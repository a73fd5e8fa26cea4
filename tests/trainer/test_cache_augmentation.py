"""The embedding cache keeps serving with random flips and crops: the second epoch finds every
encoding, and a changed caption or image misses."""
from __future__ import annotations

import re

import pytest
from PIL import Image

from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.trainer.conftest import family_job, run_trainer

pytestmark = pytest.mark.slow


def epoch_lines(stderr: str) -> dict[int, tuple[int, int]]:
    """epoch -> (hits, misses) from the trainer's per-epoch cache line."""
    return {int(e): (int(h), int(m)) for e, h, m in
            re.findall(r"epoch (\d+): embedding cache (\d+) hits, (\d+) misses", stderr)}


@pytest.mark.parametrize("family,layout", [("sd15", "captions"), ("flux-kontext", "edit-pairs")])
def test_the_second_epoch_hits_every_entry_with_random_flips_and_crops(family, layout, tiny_model, tmp_path):
    data = write_tiny_data(layout, tmp_path / "data", count=8, size=32, seed=0)
    for image in data.rglob("*.png"):  # wider than tall: a random horizontal crop at 32 px
        Image.open(image).resize((48, 32)).save(image)
    manifest = family_job(family, layout, tiny_model(family), data, tmp_path / "out",
                          data={"randomFlip": True, "centerCrop": False, "captionDropout": 0.3,
                                "cache": {"enabled": True, "uri": str(tmp_path / "cache")}},
                          training={"epochs": 3, "maxSteps": None})
    epochs = epoch_lines(run_trainer(manifest, tmp_path).stderr)
    assert epochs[0][1] > 0, "the first epoch encodes"
    assert epochs[1] == (epochs[1][0], 0) and epochs[2][1] == 0, f"epochs 2 and 3 hit every entry: {epochs}"

    # A changed caption or image is new content: it misses (and only it).
    if layout == "captions":
        lines = (data / "metadata.jsonl").read_text().splitlines()
        lines[0] = lines[0].replace('"text": "', '"text": "a changed ')
        (data / "metadata.jsonl").write_text("\n".join(lines) + "\n")
        Image.new("RGB", (48, 32), (1, 2, 3)).save(data / "0001.png")
    else:
        (data / "training_images" / "0000.txt").write_text("a changed instruction")
        Image.new("RGB", (48, 32), (1, 2, 3)).save(data / "training_images" / "0001.png")
    manifest["spec"]["training"]["epochs"] = 1
    again = epoch_lines(run_trainer(manifest, tmp_path).stderr)
    assert again[0][1] > 0, "the changed caption and image were encoded anew"
