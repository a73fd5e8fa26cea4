"""A parquet row is read out of its row group's image column: one read brings the whole group. The
prefetcher keeps the rows of that group its rank trains later (within spec.data.streaming.cacheSize,
after the window's own steps), so each row group is read about once an epoch instead of once per row
(benchmarks/data_streaming.py: parquet streamed at 0.87-0.93 of local files when every row read its
group). Indexing a file reads its footer and caption chunks, not blocks of its images, and indexing
a WebDataset shard of large images its headers and captions. Real parquet files and shards in the
local S3 server; the prefetcher run without training."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from kubetune_trainer.data.restore_data import write_parquet, write_webdataset
from tests.storage.test_data_streaming import noise_captions, upload, wait_for

ROWS, PER_GROUP = 24, 6


@pytest.fixture
def parquet_rows(bucket, tmp_path, monkeypatch):
    """(each row's member path, shuffled into one-row steps; the number of row-group reads so far)."""
    from kubetune_trainer.data import parquet
    from kubetune_trainer.data.records import Columns
    from kubetune_trainer.storage import stream

    local = noise_captions(tmp_path / "loose", ROWS)
    upload(write_parquet("captions", local, tmp_path / "parquet", per_file=ROWS, rows_per_group=PER_GROUP),
           f"s3://{bucket}/rows")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    root = Path(stream.open_stream(f"s3://{bucket}/rows"))
    [file] = root.glob("*.parquet")
    found = parquet._index(root, file, Columns("image", "text", None, None, "caption"))
    rows = [record.image for record in found]
    random.Random(0).shuffle(rows)  # an epoch's order: a group's rows spread over it
    reads = []
    real = parquet._image_column
    monkeypatch.setattr(parquet, "_image_column", lambda *args: reads.append(args[1:]) or real(*args))
    parquet._ROW_GROUPS._values.clear()
    return [[row] for row in rows], reads


def train_through(prefetcher, steps) -> list[int]:
    """Each step trained once its images are on disk; the copies on disk (bytes) at every step."""
    from kubetune_trainer.storage import stream

    held = []
    prefetcher.plan(steps)
    for number, step in enumerate(steps):
        wait_for(lambda: prefetcher.fetched > number, f"step {number} fetched")
        assert all(p.stat().st_size > 0 for p in step)
        held.append(sum(stream._size(p) or 0 for p in step[0].parent.iterdir() if not p.name.startswith(".")))
        prefetcher.advance()
    return held


def test_the_rows_a_row_group_read_brings_along_are_kept_for_their_steps(parquet_rows):
    from kubetune_trainer.storage import stream

    steps, reads = parquet_rows
    prefetcher = stream.Prefetcher(budget=1 << 30, ahead_steps=2)
    try:
        held = train_through(prefetcher, steps)
        groups = ROWS // PER_GROUP
        assert len(reads) <= groups + 2, f"{len(reads)} row-group reads for {groups} groups of {ROWS} rows"
        assert max(held) > 3 * stream._listed_size(steps[0][0]), "later rows were kept on disk"
        assert prefetcher.kept == {} and prefetcher.kept_bytes == 0, "every kept row went to its own step"
        # What the end-of-run "data stream:" line reports: rows copied along with another row's read
        # (a group's first row fetched is never one of them).
        assert 0 < prefetcher.kept_images <= ROWS - groups, prefetcher.kept_images
        copies = steps[0][0].parent
        assert all(p.stat().st_size == 0 for p in copies.iterdir() if not p.name.startswith(".")), \
            "every copy was emptied after its step"
    finally:
        prefetcher.close()


def test_kept_rows_stay_within_the_budget_and_never_crowd_out_the_window(parquet_rows):
    from kubetune_trainer.storage import stream

    steps, reads = parquet_rows
    row = max(stream._listed_size(step[0]) for step in steps)
    budget = 4 * row  # the window's 2 steps and room for about two kept rows
    prefetcher = stream.Prefetcher(budget=budget, ahead_steps=2)
    try:
        held = train_through(prefetcher, steps)
        assert prefetcher.peak <= budget, f"{prefetcher.peak} bytes counted on disk, budget {budget}"
        assert max(held) <= budget + row, f"{max(held)} bytes on disk at once, budget {budget}"
        assert ROWS // PER_GROUP + 2 < len(reads) < ROWS, \
            f"{len(reads)} reads: fewer than one a row (some kept), more than one a group (not all fit)"
    finally:
        prefetcher.close()


def test_rows_kept_for_a_plan_cut_short_are_emptied_by_the_next_plan(parquet_rows):
    from kubetune_trainer.storage import stream

    steps, _ = parquet_rows
    prefetcher = stream.Prefetcher(budget=1 << 30, ahead_steps=1)
    try:
        prefetcher.plan(steps)
        wait_for(lambda: prefetcher.kept and all(stream._size(p) for p in list(prefetcher.kept)),
                 "rows kept along with the first step")
        kept = list(prefetcher.kept)
        prefetcher.plan([])  # a resumed run plans again from where it stands
        assert prefetcher.kept_bytes == 0 and not any(stream._size(p) for p in kept)
    finally:
        prefetcher.close()


def index_streamed(written: Path, uri: str, tmp_path: Path, monkeypatch, index) -> tuple[list, int, int]:
    """WRITTEN's one container uploaded to URI and indexed streamed: (what index found, the bytes it
    read out of the container, the container's size)."""
    from kubetune_trainer.storage import stream
    from kubetune_trainer.storage.members import MEMBERS

    [size] = [p.stat().st_size for p in written.iterdir() if p.is_file()]
    upload(written, uri)
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    root = Path(stream.open_stream(uri))
    [container] = [p for p in root.iterdir() if p.is_file()]
    before = MEMBERS.ranged_bytes
    found = index(root, container)
    return found, MEMBERS.ranged_bytes - before, size


def test_indexing_a_streamed_parquet_file_reads_its_footer_and_captions_not_its_images(bucket, tmp_path, monkeypatch):
    """pyarrow reads the footer and each column chunk by an exact range: a small caption chunk between
    two groups' images must cost about its own bytes (with 1 MiB blocks the index of 20,000 images
    read 440 MB of a 1.2 GB set before the first step: benchmarks/RESULTS.md)."""
    from kubetune_trainer.data import parquet
    from kubetune_trainer.data.records import Columns

    local = noise_captions(tmp_path / "loose", 48, side=96)  # 6 row groups of 8 images of 28 KB
    written = write_parquet("captions", local, tmp_path / "parquet", per_file=48, rows_per_group=8)
    found, read, size = index_streamed(written, f"s3://{bucket}/index", tmp_path, monkeypatch, lambda root, file:
                                       parquet._index(root, file, Columns("image", "text", None, None, "caption")))
    assert len(found) == 48 and found[5].caption == "noise number 5"
    assert read < size / 4, f"indexing read {read} bytes of a {size}-byte file"


def test_indexing_a_streamed_shard_of_large_images_reads_its_headers_and_captions_not_its_images(
        bucket, tmp_path, monkeypatch):
    """tarfile reads a shard's headers in order and seeks over each image: with images of over a
    block, each header costs a probe of the shard, not the MiB of image around it (in 1 MiB blocks
    the index read about a MiB per member)."""
    from kubetune_trainer.data import webdataset
    from kubetune_trainer.data.records import Columns
    from kubetune_trainer.data.webdataset import HEADER_PROBE

    local = noise_captions(tmp_path / "loose", 8, side=700)  # 1.5 MB each
    written = write_webdataset("captions", local, tmp_path / "shards", per_file=8)
    found, read, size = index_streamed(written, f"s3://{bucket}/shards", tmp_path, monkeypatch, lambda root, shard:
                                       webdataset._index(shard, Columns(None, "text", None, None, "caption")))
    assert [record.caption for record in found] == [f"noise number {i}" for i in range(8)]
    assert read <= 8 * 2 * HEADER_PROBE < size / 10, f"indexing read {read} bytes of a {size}-byte shard"
