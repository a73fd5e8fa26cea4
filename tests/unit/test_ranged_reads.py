"""A streamed object read by ranges (storage.stream.ranged_file): every read returns the object's
bytes; a reader going on in order makes few, growing GETs; one jumping far ahead fetches a probe
around each place it reads (a shard's index: 64 KiB), not the bytes in between; by default a block,
so a small clip's header, trailer and first frame are one GET."""
from __future__ import annotations

import random

from kubetune_trainer.storage.stream import READ_AHEAD_MAX, READ_BLOCK, ranged_file

MiB = 1024 * 1024
PROBE = 64 * 1024  # what data.webdataset's index probes with


class Source:
    """An object's bytes, and each ranged read of them as (start, count)."""

    def __init__(self, size: int, seed: int = 0):
        self.data = random.Random(seed).randbytes(size)
        self.reads: list[tuple[int, int]] = []

    def read_range(self, start: int, count: int) -> bytes:
        self.reads.append((start, count))
        return self.data[start:start + count]

    @property
    def bytes_read(self) -> int:
        return sum(count for _, count in self.reads)


def test_reads_anywhere_of_any_size_return_the_objects_bytes():
    source = Source(3 * MiB + 12345)
    handle = ranged_file(source.read_range, len(source.data), block=64 * 1024)
    rng = random.Random(1)
    position = 0
    for _ in range(400):
        if rng.random() < 0.3:  # a jump anywhere, or a read on from where the last one ended
            position = rng.randrange(len(source.data) + 10)
        count = rng.choice([1, 512, 5000, 64 * 1024, 200 * 1024])
        handle.seek(position)
        assert handle.read(count) == source.data[position:position + count], (position, count)
        position = min(position + count, len(source.data))


def test_a_reader_going_on_in_order_makes_few_gets_that_grow_to_the_cap():
    source = Source(40 * MiB)
    handle = ranged_file(source.read_range, len(source.data), probe=PROBE)
    for position in range(0, len(source.data), 60_000):  # tarfile through a shard of 60 KB images
        handle.seek(position)
        assert handle.read(512) == source.data[position:position + 512]
    lengths = [count for _, count in source.reads]
    assert lengths[:3] == [PROBE, 2 * PROBE, 4 * PROBE] and max(lengths) == READ_AHEAD_MAX
    assert len(source.reads) <= 12, lengths  # 40 one-MiB blocks before
    assert source.bytes_read <= len(source.data)  # each byte fetched once


def test_places_far_apart_cost_a_probe_each_not_the_bytes_between():
    source = Source(60 * MiB)
    handle = ranged_file(source.read_range, len(source.data), probe=PROBE)
    places = range(0, len(source.data), 3 * MiB)  # a shard of 3 MB images: their headers
    for position in places:
        handle.seek(position)
        assert handle.read(512) == source.data[position:position + 512]
    assert len(source.reads) == len(places) and source.bytes_read == len(places) * PROBE


def test_a_gap_under_a_block_is_read_through_in_the_growing_spans():
    source = Source(20 * MiB)
    handle = ranged_file(source.read_range, len(source.data), probe=PROBE)
    for position in range(0, len(source.data), 300_000):  # 300 KB images: reading all beats a GET each
        handle.seek(position)
        assert handle.read(512) == source.data[position:position + 512]
    assert len(source.reads) <= 10 and source.bytes_read <= len(source.data)
    assert READ_BLOCK > 300_000


def test_a_large_read_is_one_get_of_exactly_its_bytes_and_spans_stay_bounded():
    source = Source(64 * MiB)
    handle = ranged_file(source.read_range, len(source.data), block=16 * 1024)
    handle.seek(5 * MiB)
    assert handle.read(3 * MiB) == source.data[5 * MiB:8 * MiB]
    assert source.reads == [(5 * MiB, 3 * MiB)]
    for position in range(0, len(source.data), 4096):  # in order through all of it
        handle.seek(position)
        handle.read(100)
    assert sum(map(len, handle._spans.values())) <= 2 * READ_AHEAD_MAX


def test_by_default_a_small_clips_header_trailer_and_first_frame_are_one_get():
    source = Source(700_000)  # an 81-frame 832x480 H.264 clip weighs about this
    handle = ranged_file(source.read_range, len(source.data))
    for position, count in ((0, 32), (len(source.data) - 9000, 9000), (48, 40_000)):  # ftyp, moov, a frame
        handle.seek(position)
        assert handle.read(count) == source.data[position:position + count]
    assert source.reads == [(0, len(source.data))]
