"""The first step of an epoch is loaded in the training process, where the prefetcher is fetching its
images, and read once: a read of a streamed member (a parquet row, a shard member) that the prefetcher
is fetching waits for that fetch and takes its copy, and two threads asking for one row group read it
once. The loader workers start after it, on the second step; the samples and their order do not change."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kubetune_trainer import loop
from kubetune_trainer.storage import s3, stream
from kubetune_trainer.storage.members import MEMBERS, Member, SmallCache
from kubetune_trainer.storage.uri import S3Location


class WhereLoaded:
    """Each sample is its key and the process that loaded it."""

    def __getitem__(self, key):
        return key, os.getpid()


def test_the_first_step_is_loaded_in_the_training_process_and_the_next_ones_by_the_workers():
    steps = [[[(0, 2 * s), (0, 2 * s + 1)], [(0, 2 * s + 8)]] for s in range(3)]  # 3 steps of 2 micro-batches

    loaded = [[(keys, batch) for keys, batch in step]
              for step in loop.iterate_steps(WhereLoaded(), list, 2, steps, loader_seed=0)]

    assert [[[key for key, _ in batch] for _, batch in step] for step in loaded] == steps, "the same samples, in order"
    assert [[keys for keys, _ in step] for step in loaded] == steps
    first_step_pids = {pid for _, batch in loaded[0] for _, pid in batch}
    later_pids = {pid for step in loaded[1:] for _, batch in step for _, pid in batch}
    assert first_step_pids == {os.getpid()}, "the first step is loaded in the training process"
    assert later_pids and os.getpid() not in later_pids, "the next steps by the loader workers"


class HeldRead:
    """A member's place in its container whose read is held until released (a row group on its way)."""

    def __init__(self, data: bytes):
        self.data, self.reads = data, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def read(self, member) -> bytes:
        self.reads += 1
        self.entered.set()
        assert self.release.wait(10), "the held read was never released"
        return self.data


def test_a_read_of_a_member_the_prefetcher_is_fetching_waits_for_its_copy_instead_of_reading_it_again(
        tmp_path, monkeypatch):
    container = tmp_path / "stream" / "train-0.parquet"
    container.parent.mkdir()
    container.touch()  # a streamed container's placeholder
    streamed_set = stream.Stream(S3Location("bucket", "data"), tmp_path / "stream",
                                 {"train-0.parquet": s3.StoredObject(size=1000, modified_ns=0)})
    monkeypatch.setitem(stream._STREAMS, tmp_path / "stream", streamed_set)
    monkeypatch.setattr(MEMBERS, "members", {})
    locator = HeldRead(b"the image's bytes")
    path = MEMBERS.add(Member(container, "row 0", "a.jpg", 17, locator), "row-0")

    prefetch = threading.Thread(target=stream._fill, args=(path,))
    prefetch.start()
    assert locator.entered.wait(10), "the prefetcher started its read"
    read = {}
    loader = threading.Thread(target=lambda: read.update(data=stream.read_bytes(path)))
    loader.start()
    time.sleep(0.2)  # the loader asks while the prefetcher's read is on its way
    locator.release.set()
    prefetch.join(10)
    loader.join(10)

    assert read["data"] == b"the image's bytes"
    assert locator.reads == 1, "the loader took the prefetcher's copy instead of reading the container again"
    assert Path(path).read_bytes() == b"the image's bytes"


def test_two_threads_asking_for_one_row_group_read_it_once():
    cache, computed, started = SmallCache(entries=2), [], threading.Event()

    def read_row_group():
        computed.append(1)
        started.set()
        time.sleep(0.2)
        return ["row 0", "row 1"]

    values = []
    first = threading.Thread(target=lambda: values.append(cache.get(("file", 0, "image"), read_row_group)))
    first.start()
    assert started.wait(10)
    values.append(cache.get(("file", 0, "image"), read_row_group))
    first.join(10)

    assert values == [["row 0", "row 1"]] * 2 and len(computed) == 1
