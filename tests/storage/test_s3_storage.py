"""The storage layer against a real S3 server: mirroring prefixes, checkpoints, the trainer on s3://."""
from __future__ import annotations

import json
import shutil
import threading
import time

from kubetune_trainer.checkpoint import files as checkpoints
from kubetune_trainer.checkpoint import runs
from kubetune_trainer.storage import s3
from kubetune_trainer.checkpoint.store import CheckpointStore, newest_intact
from kubetune_trainer.storage.tree import open_tree
from kubetune_trainer.storage.uploader import Task
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


def test_a_mirror_takes_its_objects_times_and_fetches_a_same_size_reupload_again(bucket, tmp_path):
    """As `aws s3 sync`: every node's mirror of a model reads the same (the embedding cache's encoder
    identity depends on it), and new weights of the same shapes are not mistaken for the old."""
    location = parse_s3(f"s3://{bucket}/models/resized")
    s3.upload_file(_written(tmp_path / "weights.bin", b"old!" * 256), location.child("weights.bin"))
    s3.upload_file(_written(tmp_path / "config.json", b"{}"), location.child("config.json"))
    stored = s3.list_stored_objects(location)
    assert {name: item.size for name, item in stored.items()} == s3.list_objects(location)

    one_node, another = tmp_path / "node-1", tmp_path / "node-2"
    for mirror in (one_node, another):
        s3.download_prefix(location, mirror)
        assert {p.name: p.stat().st_mtime_ns for p in mirror.iterdir()} == {
            name: item.modified_ns for name, item in stored.items()}

    time.sleep(1.1)  # a later LastModified, whatever the server's resolution
    s3.upload_file(_written(tmp_path / "weights.bin", b"new!" * 256), location.child("weights.bin"))
    config_inode = (one_node / "config.json").stat().st_ino
    s3.download_prefix(location, one_node)
    assert (one_node / "weights.bin").read_bytes() == b"new!" * 256, "the same size, but newer: fetched again"
    assert (one_node / "config.json").stat().st_ino == config_inode, "an unchanged object is kept"


def _written(path, data: bytes):
    path.write_bytes(data)
    return path


def save_checkpoint(root, step: int, payload: bytes = b"w"):
    """A checkpoint's files as the trainer writes them (the store adds the manifest)."""
    path = checkpoints.checkpoint_dir(root, step)
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(payload * step)
    return path


def test_checkpoints_upload_in_the_background_manifest_last_and_are_pruned_remotely(bucket, tmp_path):
    published = []
    store = CheckpointStore(f"s3://{bucket}/runs/ns/job/v0", staging=tmp_path / "staging",
                            on_published=lambda step, seconds, size: published.append((step, size)))
    for step in (2, 4, 6):
        store.publish_checkpoint(save_checkpoint(store.local, step), step, 0, None, keep_last=2)
        assert store.flush(timeout=60)  # one at a time, so none is superseded while it waits
    store.close()
    assert sorted(s3.list_children(store.remote)) == ["checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in store.local.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert published == [(2, 2), (4, 4), (6, 6)]  # weights.bin holds `step` bytes

    # A fresh machine (empty staging) finds the newest complete checkpoint in the bucket.
    assert newest_intact(store.uri, staging=tmp_path / "other") == f"{store.uri}/checkpoint-6"
    assert (tmp_path / "other" / bucket / "runs/ns/job/v0/checkpoint-6/weights.bin").is_file()


def test_a_checkpoint_superseded_while_it_waits_is_not_uploaded_and_not_pruned_early(bucket, tmp_path):
    store = CheckpointStore(f"s3://{bucket}/runs/job/v0", staging=tmp_path / "staging")
    gate = threading.Event()
    store.uploader.submit(Task("a slow upload ahead", gate.wait))  # holds the queue
    for step in (2, 4, 6):
        store.publish_checkpoint(save_checkpoint(store.local, step), step, 0, None, keep_last=1)
    assert checkpoints.checkpoint_dir(store.local, 6).is_dir()
    gate.set()
    assert store.flush(timeout=60)
    store.close()
    assert s3.list_children(store.remote) == ["checkpoint-6"], "2 and 4 were superseded before they started"
    assert [p.name for p in store.local.glob("checkpoint-*")] == ["checkpoint-6"]


def test_an_upload_without_manifest_is_never_resumed_from(bucket, tmp_path):
    store = CheckpointStore(f"s3://{bucket}/runs/job/v0", staging=tmp_path / "staging")
    complete = save_checkpoint(store.local, 2)
    store.publish_checkpoint(complete, 2, 0, None, keep_last=5)
    store.flush()
    store.close()
    # A later save that died after its files but before its manifest.
    s3.upload_file(complete / "weights.bin", store.remote.child("checkpoint-4", "weights.bin"))

    assert newest_intact(store.uri, staging=tmp_path / "other") == f"{store.uri}/checkpoint-2"
    assert not (tmp_path / "other" / bucket / "runs/job/v0/checkpoint-4").exists()


def test_a_damaged_newest_checkpoint_in_the_bucket_falls_back_with_a_warning(bucket, tmp_path, caplog):
    store = CheckpointStore(f"s3://{bucket}/runs/job/v0", staging=tmp_path / "staging")
    for step in (2, 4):
        store.publish_checkpoint(save_checkpoint(store.local, step), step, 0, None, keep_last=5)
        store.flush()
    store.close()
    s3.write_text(store.remote.child("checkpoint-4", "weights.bin"), "truncated")
    assert newest_intact(store.uri, staging=tmp_path / "other") == f"{store.uri}/checkpoint-2"
    assert "checkpoint-4: weights.bin has 9 bytes" in caplog.text and "falling back" in caplog.text


def test_run_versions_in_a_bucket_never_overwrite_and_a_restarted_run_finds_its_own(bucket):
    job = open_tree(f"s3://{bucket}/runs/team-a/job")

    def claim(run_id):
        choice = runs.look_up_version(job, run_id)
        runs.claim_version(job, choice, run_id, f"kind: TrainingJob  # {run_id}\n")
        return choice

    first = claim("uid-1")
    assert (first.version, first.continuing) == (0, False)
    job.child("v0").write_text("run.json", runs.run_record_text("uid-1", steps=7, finished=False))
    assert claim("uid-1").version == 0, "a restarted pod continues v0"
    second = claim("uid-2")
    assert (second.version, second.earlier) == (1, (0,))
    assert job.child("v1").read_text("job.yaml") == "kind: TrainingJob  # uid-2\n", "each run records its job"
    looked_up = runs.look_up_version(job, "uid-3")  # uid-2 never reached 5 steps: it goes, when claimed
    assert looked_up.abandoned == (1,) and sorted(job.children()) == ["v0", "v1"], "looking up deletes nothing"
    third = claim("uid-3")
    assert third.version == 2 and third.abandoned == (1,)
    assert sorted(job.children()) == ["v0", "v2"]


def test_a_checkpoint_of_several_ranks_completes_only_when_every_rank_recorded_its_part(bucket, tmp_path):
    """Each rank uploads its own files and records them; the main rank writes the manifest last."""
    uri = f"s3://{bucket}/runs/job/v0"
    main, other = (CheckpointStore(uri, staging=tmp_path / f"node{rank}", rank=rank, world_size=2)
                   for rank in (0, 1))
    for store, name in ((main, "shard-0.bin"), (other, "shard-1.bin")):
        path = checkpoints.checkpoint_dir(store.local, 2)
        path.mkdir(parents=True)
        (path / name).write_bytes(b"x" * 10)
        store.publish_part(path, 2, lambda path=path, name=name: [path / name])
    main.complete_checkpoint(checkpoints.checkpoint_dir(main.local, 2), 2, 0, None, keep_last=3)
    assert main.flush(timeout=60) and other.flush(timeout=60)
    manifest = json.loads(s3.read_text(main.remote.child("checkpoint-2", "manifest.json")))
    assert sorted(manifest["files"]) == ["shard-0.bin", "shard-1.bin"], "both nodes' files, in one manifest"
    assert not (checkpoints.checkpoint_dir(other.local, 2) / "shard-1.bin").exists(), \
        "a node other than the main one keeps no local copy once its part is in the bucket"
    assert newest_intact(uri, staging=tmp_path / "fresh") == f"{uri}/checkpoint-2"

    # Rank 1 dies before recording its part of checkpoint 4: the checkpoint never counts.
    path = checkpoints.checkpoint_dir(main.local, 4)
    path.mkdir(parents=True)
    (path / "shard-0.bin").write_bytes(b"y" * 10)
    main.publish_part(path, 4, lambda: [path / "shard-0.bin"])
    main.complete_checkpoint(path, 4, 0, None, keep_last=3)
    assert not main.flush(timeout=3), "the manifest waits for rank 1"
    assert s3.read_text(main.remote.child("checkpoint-4", "manifest.json")) is None
    assert newest_intact(uri, staging=tmp_path / "fresh2") == f"{uri}/checkpoint-2"
    for store in (main, other):
        store.close(wait=False)


def test_a_folder_is_mirrored_while_the_run_goes_on_and_fetched_back_on_another_machine(bucket, tmp_path):
    store = CheckpointStore(f"s3://{bucket}/runs/job/v0", staging=tmp_path / "staging")
    best = store.local / "best"
    for step in (10, 20):
        (best / f"step-{step}").mkdir(parents=True)
        (best / f"step-{step}" / "weights.bin").write_bytes(b"x" * step)
    store.mirror("best")
    store.flush()
    shutil.rmtree(best / "step-10")  # dropped from the best K
    (best / "step-30").mkdir()
    (best / "step-30" / "weights.bin").write_bytes(b"y" * 30)
    store.mirror("best")
    store.flush()
    store.close()
    assert s3.list_objects(store.remote.child("best")) == {"step-20/weights.bin": 20, "step-30/weights.bin": 30}

    elsewhere = CheckpointStore(store.uri, staging=tmp_path / "other")
    elsewhere.fetch_folder("best")
    assert sorted(p.name for p in (elsewhere.local / "best").iterdir()) == ["step-20", "step-30"]
    elsewhere.close()
