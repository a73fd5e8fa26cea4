"""A streamed data set's shards and parquet files are indexed once per node (data.node_index): the
processes of a node started together read each container's index once between them, a process
started later on the node (a restarted pod) reads none, and a container replaced in the bucket is
indexed again. Each process here is a separate interpreter indexing as a trainer's set-up does, on
real shards and parquet files in the local S3 server. The small files of a streamed tree (caption
files NAME.txt) are fetched once per node too (storage.stream.open_stream's node lock)."""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kubetune_trainer.data import parquet
from kubetune_trainer.data.restore_data import write_parquet, write_webdataset
from tests.storage.test_data_streaming import noise_captions, upload

INDEX = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from kubetune_trainer.data import parquet, webdataset
    from kubetune_trainer.data.screening import Screen
    from kubetune_trainer.data.records import Columns
    from kubetune_trainer.storage import stream
    from kubetune_trainer.storage.members import MEMBERS
    uri, data_format = sys.argv[1:]
    root = Path(stream.open_stream(uri))
    read = {"webdataset": webdataset.read_webdataset, "parquet": parquet.read_parquet}[data_format]
    records = read(root, Screen(skip_bad=False), Columns("image" if data_format == "parquet" else None, "text",
                                                         None, None, "caption"))
    index_bytes = MEMBERS.ranged_bytes
    first = stream.read_bytes(records[0].image)  # a member registered from the node's index reads too
    print(json.dumps({"records": [[str(r.image), r.caption] for r in records], "index_bytes": index_bytes,
                      "first_image": first.hex()}))
""")


def index_in_processes(uri: str, data_format: str, cache: Path, count: int) -> list[dict]:
    """COUNT interpreters started together on one node (one cache), each indexing URI: what each found."""
    env = {**os.environ, "KUBETUNE_CACHE_DIR": str(cache)}
    processes = [subprocess.Popen([sys.executable, "-c", INDEX, uri, data_format], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(count)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("data_format", ["webdataset", "parquet"])
def test_a_nodes_processes_index_each_container_once_and_a_later_process_reads_none(
        data_format, bucket, tmp_path):
    local = noise_captions(tmp_path / "loose", 12, side=96)
    stored = (write_webdataset("captions", local, tmp_path / "stored", per_file=4) if data_format == "webdataset"
              else write_parquet("captions", local, tmp_path / "stored", per_file=4, rows_per_group=2))
    upload(stored, f"s3://{bucket}/set")
    uri = f"s3://{bucket}/set"
    [alone] = index_in_processes(uri, data_format, tmp_path / "node-a", 1)
    together = index_in_processes(uri, data_format, tmp_path / "node-b", 2)
    [later] = index_in_processes(uri, data_format, tmp_path / "node-b", 1)
    captions = [caption for _, caption in alone["records"]]
    assert captions == [f"noise number {i}" for i in range(12)]
    assert alone["index_bytes"] > 0
    for result in (*together, later):  # the same records (paths under node-b's cache), images readable
        assert [caption for _, caption in result["records"]] == captions
        assert result["first_image"] == alone["first_image"]
    assert sum(result["index_bytes"] for result in together) == alone["index_bytes"], \
        "the two processes of node b read each container's index once between them"
    assert later["index_bytes"] == 0


def test_a_shard_replaced_in_the_bucket_is_indexed_again(bucket, tmp_path):
    uri = f"s3://{bucket}/set"
    upload(write_webdataset("captions", noise_captions(tmp_path / "one", 4, side=64), tmp_path / "first",
                            per_file=4), uri)
    [before] = index_in_processes(uri, "webdataset", tmp_path / "node", 1)
    replacement = noise_captions(tmp_path / "two", 4, seed=1, side=64)
    metadata = replacement / "metadata.jsonl"
    metadata.write_text(metadata.read_text().replace("noise number", "replaced number"))
    upload(write_webdataset("captions", replacement, tmp_path / "second", per_file=4), uri)
    [after] = index_in_processes(uri, "webdataset", tmp_path / "node", 1)
    assert [caption for _, caption in before["records"]] == [f"noise number {i}" for i in range(4)]
    assert [caption for _, caption in after["records"]] == [f"replaced number {i}" for i in range(4)]
    assert after["index_bytes"] > 0 and after["first_image"] != before["first_image"]


def test_a_damaged_index_on_the_node_is_made_again(bucket, tmp_path):
    uri = f"s3://{bucket}/set"
    upload(write_webdataset("captions", noise_captions(tmp_path / "loose", 4, side=64), tmp_path / "shards",
                            per_file=2), uri)
    [first] = index_in_processes(uri, "webdataset", tmp_path / "node", 1)
    kept = sorted((tmp_path / "node" / "indexes").glob("*.pickle"))
    assert len(kept) == 2  # one per shard
    kept[0].write_bytes(kept[0].read_bytes()[:100])  # cut short, as a full disk leaves a file
    [again] = index_in_processes(uri, "webdataset", tmp_path / "node", 1)
    assert again["records"] == first["records"] and 0 < again["index_bytes"] < first["index_bytes"]


LAY_OUT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from kubetune_trainer.storage import s3, stream
    uri, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    fetched, download = [], s3.download_file
    def slow_download(location, target, modified_ns=None, size=None):  # a round trip across a network: they overlap
        time.sleep(0.2)
        fetched.append(location.key)
        download(location, target, modified_ns, size)
    s3.download_file = slow_download
    ready.touch()
    while not go.exists():  # every process imported: they open the stream at the same moment
        time.sleep(0.01)
    root = Path(stream.open_stream(uri))
    print(json.dumps({"fetched": len(fetched), "captions": sorted(p.read_text() for p in root.rglob("*.txt"))}))
""")


def test_a_nodes_processes_fetch_each_caption_file_once_between_them(bucket, tmp_path):
    from tests.trainer.test_captions_layout import as_caption_files

    local = as_caption_files(noise_captions(tmp_path / "jsonl", 40, side=16), tmp_path / "kohya")
    upload(local, f"s3://{bucket}/kohya")
    go, ready = tmp_path / "go", [tmp_path / f"ready-{i}" for i in range(2)]
    env = {**os.environ, "KUBETUNE_CACHE_DIR": str(tmp_path / "node")}
    processes = [subprocess.Popen([sys.executable, "-c", LAY_OUT, f"s3://{bucket}/kohya", str(ready[i]), str(go)],
                                  env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i in range(2)]
    deadline = time.monotonic() + 120
    while not all(path.exists() for path in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both have imported: they open the stream together
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    expected = sorted(f"noise number {i}" for i in range(40))
    assert all(result["captions"] == expected for result in results)
    assert sum(result["fetched"] for result in results) == 40, \
        "one process laid the tree out, the other waited and found every caption file there"


def test_every_parquet_read_stays_on_the_calling_thread():
    """pyarrow decoding what it reads through a Python file object on its own thread pool could abort the
    process as it exited, its work done (exit 134; in the test above about one indexing process in 60 under
    load): data.parquet.PYARROW_THREADS says why. Every read there asks for no threads."""
    source = inspect.getsource(parquet)
    reads = re.findall(r"\.(?:read|read_row_group|read_row_groups|iter_batches)\(([^)]*)\)", source)
    assert reads and all("use_threads=PYARROW_THREADS" in arguments for arguments in reads), reads
    assert parquet.PYARROW_THREADS is False
