"""Parquet files and WebDataset shards streamed from s3:// train exactly what the same samples as loose
local files train, on one process and on two: images are fetched one by one out of the shards by
ranged reads (never a whole shard), within the prefetcher's budget, by loader workers too."""
from __future__ import annotations

from pathlib import Path

import pytest

from kubetune_trainer.data.restore_data import write_parquet, write_webdataset
from tests.storage.test_data_streaming import fetched_images, streamed_job, upload
from tests.trainer.conftest import captions_data, run_dir, tiny_sd15, trained_weights  # noqa: F401
from tests.trainer.test_distributed import RELATIVE_TOLERANCE, max_difference, train

pytestmark = pytest.mark.slow

STEPS = 2


def test_parquet_and_webdataset_streamed_from_s3_train_the_weights_of_loose_files_on_one_and_two_processes(
        bucket, tiny_sd15, captions_data, tmp_path):
    loose = captions_data
    upload(write_parquet("captions", loose, tmp_path / "parquet", per_file=3), f"s3://{bucket}/parquet")
    # One row group a file: each rank keeps the rows of its group it trains later (room for them here).
    upload(write_parquet("captions", loose, tmp_path / "parquet-groups", per_file=3, rows_per_group=3),
           f"s3://{bucket}/parquet-groups")
    upload(write_webdataset("captions", loose, tmp_path / "webdataset", per_file=3), f"s3://{bucket}/webdataset")
    one_image = max(p.stat().st_size for p in loose.glob("*.png"))
    cache = tmp_path / "cache"

    def job(name: str, uri: str, data_format: str, workers: int = 0, processes: int = 1,
            cache_images: int = 2) -> dict:
        manifest = streamed_job(tiny_sd15, uri, tmp_path / name, workers=workers, steps=STEPS,
                                cacheSize=str(cache_images * one_image), prefetchSteps=1)
        manifest["spec"]["data"]["format"] = data_format
        manifest["spec"]["training"]["batchSize"] = 2 // processes  # one global batch of 2 at any count
        manifest["spec"]["checkpoints"]["everySteps"] = 1  # checkpoint-1: how much a step changes
        return manifest

    runs = {  # name: (manifest, processes)
        "loose-1": (job("loose-1", str(loose), "files"), 1),
        "parquet-1": (job("parquet-1", f"s3://{bucket}/parquet", "parquet"), 1),
        "loose-2": (job("loose-2", str(loose), "files", processes=2), 2),
        "parquet-2": (job("parquet-2", f"s3://{bucket}/parquet-groups", "parquet", processes=2, cache_images=8), 2),
        # Loader workers (forked processes) read members too.
        "webdataset-2": (job("webdataset-2", f"s3://{bucket}/webdataset", "webdataset", workers=1, processes=2), 2),
    }
    logs = {name: train(manifest, tmp_path, nproc, extra_env={"KUBETUNE_CACHE_DIR": str(cache)})
            for name, (manifest, nproc) in runs.items()}
    weights = {name: trained_weights(run_dir(tmp_path / name) / f"checkpoint-{STEPS}") for name in runs}

    assert max_difference(weights["parquet-1"], weights["loose-1"]) == 0, "parquet trains what loose files train"
    assert max_difference(weights["parquet-2"], weights["loose-2"]) == 0, "on two processes, rows kept or not"
    assert max_difference(weights["webdataset-2"], weights["loose-2"]) == 0, "so do shards, on two processes"
    trained = max_difference(weights["loose-1"], trained_weights(run_dir(tmp_path / "loose-1") / "checkpoint-1"))
    # Two processes sum the same samples' gradients in another order: equal to a thousandth of a step.
    assert max_difference(weights["loose-1"], weights["loose-2"]) < RELATIVE_TOLERANCE * trained

    for name in ("parquet-1", "parquet-2", "webdataset-2"):
        assert fetched_images(logs[name]) > 0, f"{name}: images came out of the objects by ranged reads"
    containers = [p for p in (cache / "stream" / bucket).rglob("*") if p.suffix in (".parquet", ".tar")]
    assert len(containers) == 9 and all(p.stat().st_size == 0 for p in containers), \
        "no parquet file or shard was fetched whole: they stay placeholders"
    copies = [p for p in (cache / "stream" / bucket).rglob("*") if p.is_file() and p.parent.name.endswith(".members")]
    assert all(p.stat().st_size == 0 for p in copies), "every prefetched or kept image was evicted after its step"
