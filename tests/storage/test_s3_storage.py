"""The storage layer against a real S3 server: mirroring prefixes, checkpoints, the trainer on s3://."""
from __future__ import annotations

import json

from kubetune_trainer import checkpoints
from kubetune_trainer.storage import s3
from kubetune_trainer.storage.checkpoint_store import CheckpointStore
from kubetune_trainer.storage.uri import parse_s3


def test_a_directory_round_trips_through_a_prefix(bucket, tmp_path):
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "a.txt").write_text("alpha")
    (source / "sub" / "b.bin").write_bytes(bytes(range(256)) * 100)
    location = parse_s3(f"s3://{bucket}/some/prefix")
    s3.upload_files(sorted(p for p in source.rglob("*") if p.is_file()), source, location)

    assert s3.list_objects(location) == {"a.txt": 5, "sub/b.bin": 25600}
    assert s3.list_children(location) == ["sub"]
    copy = tmp_path / "copy"
    s3.download_prefix(location, copy)
    assert (copy / "a.txt").read_text() == "alpha"
    assert (copy / "sub" / "b.bin").read_bytes() == (source / "sub" / "b.bin").read_bytes()

    s3.delete_prefix(location)
    assert s3.list_objects(location) == {}


def test_checkpoints_are_published_manifest_last_and_pruned_remotely(bucket, tmp_path):
    store = CheckpointStore(f"s3://{bucket}/runs/job", staging=tmp_path / "staging")
    for step in (2, 4, 6):
        path = checkpoints.checkpoint_dir(store.local, step)
        path.mkdir(parents=True)
        (path / "weights.bin").write_bytes(b"w" * step)
        checkpoints.write_manifest(path, step=step, epoch=0, loss=None)
        store.publish(path)
        store.prune(keep_last=2)
    assert sorted(s3.list_children(store.remote)) == ["checkpoint-4", "checkpoint-6"]

    # A fresh machine (empty staging) finds the newest complete checkpoint in the bucket.
    elsewhere = CheckpointStore(store.uri, staging=tmp_path / "other")
    elsewhere.fetch_latest()
    assert checkpoints.latest_complete(elsewhere.local).step == 6


def test_an_upload_without_manifest_is_never_fetched(bucket, tmp_path):
    store = CheckpointStore(f"s3://{bucket}/runs/job", staging=tmp_path / "staging")
    complete = checkpoints.checkpoint_dir(store.local, 2)
    complete.mkdir(parents=True)
    (complete / "weights.bin").write_bytes(b"old")
    checkpoints.write_manifest(complete, step=2, epoch=0, loss=None)
    store.publish(complete)
    # A later save that died after its files but before its manifest.
    s3.upload_file(complete / "weights.bin", store.remote.child("checkpoint-4", "weights.bin"))

    elsewhere = CheckpointStore(store.uri, staging=tmp_path / "other")
    elsewhere.fetch_latest()
    assert checkpoints.latest_complete(elsewhere.local).step == 2
    assert not checkpoints.checkpoint_dir(elsewhere.local, 4).exists()
