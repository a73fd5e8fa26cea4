"""Edit pairs with two control images each, stored as loose files, as parquet (a control column holding
a list of images per row, datasets' Sequence(Image())) and as WebDataset shards (KEY.control_0.png,
KEY.control_1.png members), train qwen-image-edit-plus to the same weights: on one process and on two."""
from __future__ import annotations

import pytest

from kubetune_trainer.data.restore_data import write_parquet, write_webdataset
from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.trainer.conftest import family_job, run_dir, trained_weights
from tests.trainer.test_distributed import RELATIVE_TOLERANCE, max_difference, train

pytestmark = pytest.mark.slow

FAMILY = "qwen-image-edit-plus"
STEPS = 2


def test_edit_pairs_as_loose_files_parquet_and_webdataset_train_the_same_weights_on_one_and_two_processes(
        tiny_model, tmp_path):
    """Over a minute: five runs (three formats on one process, two on two processes) compared weight for weight."""
    loose = write_tiny_data("edit-pairs", tmp_path / "loose", count=4, size=32, seed=0, references=2)
    roots = {"files": loose, "parquet": write_parquet("edit-pairs", loose, tmp_path / "pq", per_file=3),
             "webdataset": write_webdataset("edit-pairs", loose, tmp_path / "wd", per_file=3)}
    model = tiny_model(FAMILY)

    def job(name: str, data_format: str, processes: int) -> dict:
        manifest = family_job(FAMILY, "edit-pairs", model, roots[data_format], tmp_path / name,
                              data={"format": data_format, "randomFlip": True, "centerCrop": False},
                              training={"batchSize": 2 // processes},  # one global batch of 2 at any count
                              checkpoints={"everySteps": 1})          # checkpoint-1: how much a step changes
        return manifest

    runs = {"files-1": ("files", 1), "parquet-1": ("parquet", 1), "files-2": ("files", 2),
            "webdataset-2": ("webdataset", 2)}
    for name, (data_format, processes) in runs.items():
        train(job(name, data_format, processes), tmp_path, processes)
    weights = {name: trained_weights(run_dir(tmp_path / name) / f"checkpoint-{STEPS}") for name in runs}

    assert max_difference(weights["parquet-1"], weights["files-1"]) == 0, "a list column trains the loose references"
    assert max_difference(weights["webdataset-2"], weights["files-2"]) == 0, "so do numbered shard members, on two"
    trained = max_difference(weights["files-1"], trained_weights(run_dir(tmp_path / "files-1") / "checkpoint-1"))
    assert trained > 0
    # Two processes sum the same samples' gradients in another order: equal to a thousandth of a step.
    assert max_difference(weights["files-1"], weights["files-2"]) < RELATIVE_TOLERANCE * trained
