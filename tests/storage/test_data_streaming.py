"""s3:// data sets are streamed as training goes (kubetune_trainer.storage.stream): laid out from one
listing, each rank's images fetched just ahead of its steps and evicted after them, so the disk
holds a bounded share of the set; a resumed run streams from its position; a broken image is
named when training reaches it."""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.uri import parse_s3
from tests.trainer.conftest import (family_job, run_dir, run_trainer_expecting_failure, tiny_sd15,  # noqa: F401
                                    trained_weights, trainer_env, write_manifest)
from tests.trainer.test_distributed import max_difference, train
from tests import warm_python

pytestmark = pytest.mark.slow

SIDE = 40  # noise does not compress: each PNG is about SIDE x SIDE x 3 bytes


def noise_captions(directory: Path, count: int, seed: int = 0, side: int = SIDE) -> Path:
    """A captions data set of COUNT random-noise images (so their sizes are real)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    lines = []
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(directory / f"{i:03d}.png")
        lines.append(json.dumps({"file_name": f"{i:03d}.png", "text": f"noise number {i}"}))
    (directory / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def upload(local: Path, uri: str) -> None:
    s3.upload_files(sorted(p for p in local.rglob("*") if p.is_file()), local, parse_s3(uri))


def image_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.png") if p.is_file())


class DiskWatcher:
    """The most bytes of images on disk under ROOT, sampled every few milliseconds from outside."""

    def __init__(self, root: Path):
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.wait(0.005):
            try:
                self.peak = max(self.peak, image_bytes(self.root))
            except FileNotFoundError:
                pass  # a file swapped between listing and stat

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_the_tree_is_laid_out_from_one_listing_and_images_arrive_when_read(bucket, tmp_path, monkeypatch):
    from kubetune_trainer.storage import stream

    local = noise_captions(tmp_path / "data", 6)
    upload(local, f"s3://{bucket}/streamed/layout")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    root = Path(stream.open_stream(f"s3://{bucket}/streamed/layout"))
    assert (root / "metadata.jsonl").read_text() == (local / "metadata.jsonl").read_text(), "small files at once"
    assert image_bytes(root) == 0 and len(list(root.glob("*.png"))) == 6, "every image a placeholder"

    assert stream.image_size(root / "002.png") == (SIDE, SIDE)
    assert (root / "002.png").stat().st_size == 0, "the size came from the header, nothing was kept"
    assert stream.read_bytes(root / "003.png") == (local / "003.png").read_bytes()
    assert (root / "003.png").stat().st_size == (local / "003.png").stat().st_size
    assert stream.streamed(root).fetched_images == 1

    # The pod's container restarts (its disk kept) after a caption was fixed in place, same length.
    time.sleep(1.1)  # a later LastModified, whatever the server's resolution
    fixed = (local / "metadata.jsonl").read_text().replace("noise number 4", "noise Number 4")
    (local / "metadata.jsonl").write_text(fixed)
    s3.upload_file(local / "metadata.jsonl", parse_s3(f"s3://{bucket}/streamed/layout/metadata.jsonl"))
    retouched = bytearray((local / "003.png").read_bytes())  # the image it had fetched, replaced: same size
    retouched[-20] ^= 0xFF
    (local / "003.png").write_bytes(retouched)
    s3.upload_file(local / "003.png", parse_s3(f"s3://{bucket}/streamed/layout/003.png"))
    assert Path(stream.open_stream(f"s3://{bucket}/streamed/layout")) == root
    assert (root / "metadata.jsonl").read_text() == fixed, "the same size, but newer: fetched again"
    assert stream.read_bytes(root / "003.png") == retouched, "an image left by the last container, gone stale"


def test_the_prefetcher_keeps_the_next_steps_within_its_budget_and_evicts_trained_ones(bucket, tmp_path, monkeypatch):
    from kubetune_trainer.storage import stream

    local = noise_captions(tmp_path / "data", 12)
    upload(local, f"s3://{bucket}/streamed/prefetch")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    root = Path(stream.open_stream(f"s3://{bucket}/streamed/prefetch"))
    one_image = (local / "000.png").stat().st_size
    steps = [[root / f"{2 * s:03d}.png", root / f"{2 * s + 1:03d}.png"] for s in range(6)]
    prefetcher = stream.Prefetcher(budget=int(4.5 * one_image), ahead_steps=4)
    try:
        prefetcher.plan(steps)
        wait_for(lambda: prefetcher.fetched == 2, "two steps (four images) fit the budget")
        time.sleep(0.2)
        assert prefetcher.fetched == 2, "a third step would pass the budget"
        assert image_bytes(root) <= 4.5 * one_image
        prefetcher.advance()
        assert all(p.stat().st_size == 0 for p in steps[0]), "the trained step's images are placeholders again"
        wait_for(lambda: prefetcher.fetched == 3, "room for the next step")
        assert all(p.stat().st_size > 0 for step in steps[1:3] for p in step)
        assert all(p.stat().st_size == 0 for step in steps[3:] for p in step), "nothing beyond the budget"
    finally:
        prefetcher.close()


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def streamed_job(model, data_uri, out, workers: int = 0, steps: int = 6, **streaming) -> dict:
    return family_job("sd15", "captions", model, data_uri, out,
                      training={"maxSteps": steps, "batchSize": 2, "optimizer": "sgd", "sgdMomentum": 0.0,
                                "learningRate": 0.1, "weightDecay": 0.0},
                      data={"numWorkers": workers, **({"streaming": streaming} if streaming else {})},
                      checkpoints={"everySteps": 3})


def test_two_processes_stream_a_set_larger_than_their_disk_and_train_what_local_data_trains(
        bucket, tiny_sd15, tmp_path):
    local = noise_captions(tmp_path / "data", 64)
    upload(local, f"s3://{bucket}/streamed/bigger-than-disk")
    one_image = (local / "000.png").stat().st_size
    budget = 3 * one_image  # per process: less than a quarter of the set
    cache = tmp_path / "cache"
    # Two loader workers per process read (and so fetch) images too, in processes of their own.
    streamed = streamed_job(tiny_sd15, f"s3://{bucket}/streamed/bigger-than-disk", tmp_path / "streamed",
                            workers=2, steps=16, cacheSize=str(budget), prefetchSteps=2)
    with DiskWatcher(cache / "stream") as disk:
        log = train(streamed, tmp_path, nproc=2, extra_env={"KUBETUNE_CACHE_DIR": str(cache)})
    assert "2 process(es)" in log
    per_process_step = 2 * one_image  # each rank's share of a step (of 16, over 64 images): a micro-batch of 2
    loaded_ahead = 2 * 2 * per_process_step  # each worker loads up to 2 batches ahead (torch's prefetch)
    assert 0 < disk.peak <= 2 * (budget + per_process_step + loaded_ahead), (disk.peak, budget)
    assert disk.peak < image_bytes(local) / 2, "never the whole set on disk"

    train(streamed_job(tiny_sd15, str(local), tmp_path / "local", steps=16), tmp_path, nproc=2)
    steps = {name: trained_weights(run_dir(tmp_path / name) / "checkpoint-16") for name in ("streamed", "local")}
    assert max_difference(steps["streamed"], steps["local"]) == 0, "streamed data trains exactly what local data trains"


def fetched_images(log: str) -> int:
    return int(re.search(r"data stream: (\d+) images fetched", log).group(1))


def test_the_cache_stage_of_a_streamed_set_fetches_each_image_once_within_the_budget(bucket, tiny_sd15, tmp_path):
    """`kubetune train --cache-only` (the operator's cache init container) on two processes: each
    encodes its share, its images fetched ahead and evicted once encoded; training then hits."""
    local = noise_captions(tmp_path / "data", 16)
    upload(local, f"s3://{bucket}/streamed/cache-stage")
    one_image = (local / "000.png").stat().st_size
    budget = 2 * one_image
    manifest = streamed_job(tiny_sd15, f"s3://{bucket}/streamed/cache-stage", tmp_path / "out", steps=4,
                            cacheSize=str(budget), prefetchSteps=1)
    manifest["spec"]["data"]["cache"] = {"enabled": True, "uri": str(tmp_path / "embeddings")}
    env = {"KUBETUNE_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "kubetune_cli.main", "train", "-f", str(write_manifest(manifest, tmp_path)),
               "--nproc", "2", "--cache-only"]
    with DiskWatcher(tmp_path / "cache" / "stream") as disk:
        result = warm_python.run(command, env={**trainer_env(), **env}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    fetched = [int(n) for n in re.findall(r"data stream: (\d+) images fetched", result.stderr)]
    assert fetched == [8], "rank 0 (the one that logs) fetched its half, each image once"
    one_batch = 2 * one_image
    assert 0 < disk.peak <= 2 * (budget + one_batch), (disk.peak, budget)
    assert disk.peak < image_bytes(local) / 2, "never the whole set on disk"

    log = train(manifest, tmp_path, nproc=2, extra_env=env)
    assert re.search(r"embedding cache: [1-9]\d* hits, 0 misses", log), log[-2000:]


def test_a_resumed_run_streams_from_its_saved_position(bucket, tiny_sd15, tmp_path, monkeypatch):
    from tests.trainer.conftest import run_trainer

    upload(noise_captions(tmp_path / "data", 8), f"s3://{bucket}/streamed/resume")
    monkeypatch.setenv("KUBETUNE_RUN_ID", "uid-of-the-trainingjob")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    manifest = streamed_job(tiny_sd15, f"s3://{bucket}/streamed/resume", tmp_path / "out")
    manifest["spec"]["training"]["maxSteps"] = 3
    first = run_trainer(manifest, tmp_path).stderr
    assert fetched_images(first) == 3 * 2, "three steps of two images"
    manifest["spec"]["training"]["maxSteps"] = 6
    resumed = run_trainer(manifest, tmp_path).stderr
    assert "resumed from" in resumed and "at step 3" in resumed
    assert fetched_images(resumed) == 3 * 2, "only the images of steps 4-6: the stream continued at step 3"


def test_a_broken_streamed_image_stops_the_run_naming_it_and_keeps_its_checkpoints(
        bucket, tiny_sd15, tmp_path, monkeypatch):
    local = noise_captions(tmp_path / "data", 8)
    (local / "005.png").write_bytes(b"not a png at all")
    upload(local, f"s3://{bucket}/streamed/broken")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    from kubetune_trainer.data.sampler import epoch_steps

    # A seed whose training order reaches image 5 (metadata line 6) after at least one step.
    seed, reached = next((seed, step) for seed in range(1, 50)
                         for step, keys in enumerate(epoch_steps(8, 2, seed, 0)) if (0, 5) in keys and step > 0)
    manifest = streamed_job(tiny_sd15, f"s3://{bucket}/streamed/broken", tmp_path / "out")
    manifest["spec"]["training"].update(maxSteps=4, seed=seed)
    manifest["spec"]["checkpoints"]["everySteps"] = 1
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    assert "005.png: cannot be read as an image" in stderr and "streaming.enabled false" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    assert (run_dir(tmp_path / "out") / f"checkpoint-{reached}" / "manifest.json").is_file(), \
        f"the {reached} step(s) before the broken image were checkpointed and kept"


def test_caption_files_stream_as_local_ones_read_and_a_restart_sees_a_fixed_caption_and_a_removed_sample(
        bucket, tmp_path, monkeypatch):
    from kubetune_trainer.data.captions import read_captions
    from kubetune_trainer.data.screening import Screen
    from kubetune_trainer.storage import stream
    from tests.trainer.test_captions_layout import as_caption_files

    local = as_caption_files(noise_captions(tmp_path / "jsonl", 4), tmp_path / "txt",
                             folders=lambda name: "set-b" if name >= "002" else "set-a")
    upload(local, f"s3://{bucket}/kohya")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    root = Path(stream.open_stream(f"s3://{bucket}/kohya"))

    def samples(folder: Path) -> list[tuple[str, str]]:
        return [(s.path.relative_to(folder).as_posix(), s.caption) for s in read_captions(folder, Screen(skip_bad=False))]

    assert samples(root) == samples(local) == [(f"set-{'a' if i < 2 else 'b'}/{i:03d}.png", f"noise number {i}")
                                               for i in range(4)]
    assert image_bytes(root) == 0, "the images are still placeholders: the captions came with the listing"

    time.sleep(1.1)  # a later LastModified, whatever the server's resolution
    (local / "set-b" / "003.txt").write_text("noise Number 3")  # fixed in place, same length
    s3.upload_file(local / "set-b" / "003.txt", parse_s3(f"s3://{bucket}/kohya/set-b/003.txt"))
    assert Path(stream.open_stream(f"s3://{bucket}/kohya")) == root  # the pod's container restarted
    assert samples(root)[3] == ("set-b/003.png", "noise Number 3")

    for name in ("set-a/000.png", "set-a/000.txt"):  # a sample taken out of the bucket
        s3.delete_object(parse_s3(f"s3://{bucket}/kohya/{name}"))
    copy = root / "set-b" / "shard.tar.members" / "0001.png"  # where another process copies a shard's member
    copy.parent.mkdir()
    copy.write_bytes(b"a member's bytes")
    assert Path(stream.open_stream(f"s3://{bucket}/kohya")) == root  # restarted again
    assert [name for name, _ in samples(root)] == ["set-a/001.png", "set-b/002.png", "set-b/003.png"]
    assert not (root / "set-a" / "000.png").exists() and copy.read_bytes() == b"a member's bytes"
