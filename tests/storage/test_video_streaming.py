"""Video clips streamed from s3:// (loose, and as WebDataset members) train exactly what the same clips on
local disk train: probed from their headers by ranged reads (no clip fetched whole) as training
reaches them, or before the first step where the sampler needs them (spec.data.bucketing, several
frame counts, spec.data.skipBad: screened there as local clips are), fetched ahead of their steps
by the prefetcher and its loader workers, evicted after.

Per-rank sharding and resume are the images' code path (run.images_of over any sample's Path fields,
storage.stream.Prefetcher): tests/storage/test_data_streaming.py and test_data_formats_streaming.py
prove them on two processes; this test runs one."""
from __future__ import annotations

from pathlib import Path

import pytest

from kubetune_trainer.data.video import probe
from kubetune_trainer.data.restore_data import write_webdataset
from kubetune_trainer.storage.stream import open_stream, remote
from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.storage.test_data_streaming import fetched_images, upload
from tests.trainer.conftest import family_job, run_dir, run_trainer_expecting_failure, trained_weights
from tests.trainer.test_distributed import max_difference, train
from tests.trainer.test_hostile_input import no_traceback

pytestmark = pytest.mark.slow

CLIPS = 4  # two steps of two: every clip is trained once


def wan_job(model: Path, uri: str, out: Path, data_format: str, workers: int = 0, bucketing: bool = False,
            **streaming) -> dict:
    return family_job("wan", "video-captions", model, uri, out,
                      data={"format": data_format, "frames": 5, "numWorkers": workers, "bucketing": bucketing,
                            **({"streaming": streaming} if streaming else {})})


def test_clips_streamed_from_s3_loose_and_in_shards_train_the_weights_of_local_clips(bucket, tiny_model,
                                                                                    tmp_path, monkeypatch):
    loose = write_tiny_data("video-captions", tmp_path / "loose", count=CLIPS, size=32, seed=0)
    upload(loose, f"s3://{bucket}/loose")
    upload(write_webdataset("video-captions", loose, tmp_path / "shards", per_file=2), f"s3://{bucket}/shards")
    one_clip = max(p.stat().st_size for p in loose.glob("**/*.mp4"))
    cache = tmp_path / "cache"

    # Probed where they are: frame counts, rates and sizes of the local clips, not one byte on disk.
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(cache / "probe"))
    root = Path(open_stream(f"s3://{bucket}/loose"))
    placeholders = sorted(root.glob("**/*.mp4"))
    assert len(placeholders) == CLIPS and all(remote(p) for p in placeholders)
    for placeholder in placeholders:
        streamed, local = probe(placeholder), probe(loose / placeholder.relative_to(root))
        assert (streamed.frames, streamed.rate, streamed.width, streamed.height) == \
               (local.frames, local.rate, local.width, local.height)
    assert all(p.stat().st_size == 0 for p in placeholders), "a probe reads ranges, it fetches no clip whole"

    model = tiny_model("wan")
    budget = {"cacheSize": str(2 * one_clip), "prefetchSteps": 1}
    runs = {"local": wan_job(model, str(loose), tmp_path / "local", "files"),
            "loose": wan_job(model, f"s3://{bucket}/loose", tmp_path / "loose-s3", "files", **budget),
            # Loader workers (forked) read the shard members too.
            "shards": wan_job(model, f"s3://{bucket}/shards", tmp_path / "shards-s3", "webdataset", workers=1,
                              **budget)}
    logs = {name: train(manifest, tmp_path, 1, extra_env={"KUBETUNE_CACHE_DIR": str(cache)})
            for name, manifest in runs.items()}
    weights = {name: trained_weights(run_dir(Path(manifest["spec"]["checkpoints"]["uri"])) / "checkpoint-2")
               for name, manifest in runs.items()}
    assert max_difference(weights["loose"], weights["local"]) == 0, "loose clips streamed train as local ones"
    assert max_difference(weights["shards"], weights["local"]) == 0, "so do clips streamed out of shards"

    for name in ("loose", "shards"):  # by the prefetcher of the training process (a worker counts its own)
        assert 0 < fetched_images(logs[name]) <= CLIPS, f"{name}: each clip fetched at most once"
    streamed_files = [p for p in (cache / "stream" / bucket).rglob("*") if p.suffix in (".mp4", ".tar")]
    # The loose clips, the 2 shards, and the shards' members' copies (SHARD.members/KEY.mp4).
    assert len(streamed_files) == CLIPS + 2 + CLIPS, streamed_files
    assert all(p.stat().st_size == 0 for p in streamed_files), \
        "every clip was evicted after its step, and no shard was fetched whole"


def test_a_streamed_file_that_is_not_a_video_is_named_before_training_from_its_header(bucket, tiny_model,
                                                                                     tmp_path, monkeypatch):
    """Streamed clips the sampler buckets (spec.data.bucketing) are screened before the first step as
    local ones are (their probe reads headers only): refused in one line naming the clip, before
    anything is written. (Without buckets a clip is probed as training reaches it: the message is
    tests/trainer/test_video_captions_layout.py's.)"""
    loose = write_tiny_data("video-captions", tmp_path / "loose", count=2, size=32, seed=0)
    broken = sorted(loose.glob("**/*.mp4"))[1]
    broken.write_bytes(b"<html>not a video</html>" * 20)
    upload(loose, f"s3://{bucket}/broken")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    manifest = wan_job(tiny_model("wan"), f"s3://{bucket}/broken", tmp_path / "out", "files", bucketing=True)
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    named = tmp_path / "cache" / "stream" / bucket / "broken" / broken.relative_to(loose)
    assert f"{named}: cannot be read as a video" in stderr, stderr[-3000:]
    assert "or set spec.data.skipBad: true to skip bad samples" in stderr, "the screen's refusal: skipBad applies"
    assert no_traceback(stderr)
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"
