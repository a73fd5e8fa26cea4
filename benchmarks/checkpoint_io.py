"""Checkpoint I/O: what a checkpoint costs training, and how fast it reaches S3.

    .venv/bin/python benchmarks/checkpoint_io.py                 # 256 MiB checkpoint, 3 rounds
    .venv/bin/python benchmarks/checkpoint_io.py --size-mib 1024 --rounds 5

Starts a real S3 server (versitygw, built by devcluster/build.sh) on loopback and checkpoints a
model the way the trainer does (checkpointing.ShardedState: trained weights plus AdamW's two
moments as one torch.distributed.checkpoint state, about --size-mib in all; the trainer's small
files beside it), then measures per round:
  stall    what training waits for: the state copied to CPU memory (DCP's async save stages it)
           and the part handed to the background;
  write    the background thread writing the shards to local disk;
  upload   from the start of the checkpoint until it is complete in the bucket: written, hashed,
           uploaded (parallel files, multipart), its part recorded and the manifest last;
  boto3    the same files with a plain sequential boto3 `upload_file` each, default settings —
           what a hand-written sync does (for throughput only; nothing orders its manifest).
Before sharded async saves (2026-11-21, same machine) training waited 0.95 s per 256 MiB and
3.72 s per GiB for torch.save/safetensors on its own thread. Medians are printed (a benchmark,
not a test: nothing is asserted).
"""
from __future__ import annotations

import argparse
import os
import secrets
import statistics
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from kubetune_api.ports import free_listen_port


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="total checkpoint size (approximately)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pause", type=float, default=5.0,
                        help="seconds between checkpoints, as training steps would be (the disk's write-back of "
                             "the previous one otherwise competes with the next copy)")
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of starting versitygw (AWS_* env "
                        "credentials; creates a bucket)")
    return parser.parse_args(argv)


def start_versitygw(root: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    from kubetune_dev import versions

    port = free_listen_port()
    access, secret = "bench" + secrets.token_hex(4), secrets.token_hex(16)
    process = subprocess.Popen([str(versions.binary("versitygw")), "--access", access, "--secret", secret,
                                "--region", "us-east-1", "--port", f"127.0.0.1:{port}", "posix", str(root)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            time.sleep(0.1)
    return process, {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": access,
                     "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}


def trained_model(size_mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Trained weights of size_mib / 3 and an AdamW that has stepped once (its state is twice that)."""
    elements = 4 * 1024 * 1024  # 16 MiB of fp32 per parameter
    count = max(1, size_mib // 3 // 16)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(elements)) for _ in range(count)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return model, optimizer


def write_small_files(path: Path) -> None:
    """What the main process writes beside the sharded state (position, schedule, RNG)."""
    (path / "trainer_state.json").write_text("{}")
    torch.save({"torch": torch.get_rng_state()}, path / "rng-rank0.pt")


def mib_per_s(size: int, seconds: float) -> float:
    return size / 1024 / 1024 / seconds


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kubetune-ckpt-bench-"))
    server = None
    if args.endpoint:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    else:
        (work / "s3").mkdir()
        server, settings = start_versitygw(work / "s3")
        os.environ.update(settings)
    import boto3

    from kubetune_trainer.checkpoint.sharded import ShardedState, files_of_rank
    from kubetune_trainer.storage import s3
    from kubetune_trainer.checkpoint.store import CheckpointStore

    s3.forget_clients()
    bucket = "bench-" + secrets.token_hex(4)
    s3.client().create_bucket(Bucket=bucket)
    rows = []
    model, optimizer = trained_model(args.size_mib)  # made once: only checkpointing is timed
    sharded = ShardedState(model, optimizer)
    try:
        for round_ in range(1, args.rounds + 1):
            done = {}
            store = CheckpointStore(f"s3://{bucket}/runs/bench/job/v{round_}", staging=work / "staging",
                                    on_published=lambda step, seconds, size: done.update(
                                        published=time.perf_counter(), size=size))
            path = store.local / f"checkpoint-{round_}"
            started = time.perf_counter()
            path.mkdir(parents=True)
            saving = sharded.save(path)
            write_small_files(path)
            store.publish_part(path, round_, lambda path=path: files_of_rank(path, 0, 1), written=saving.result)
            store.complete_checkpoint(path, round_, 0, 0.1, keep_last=10)
            stall = time.perf_counter() - started
            saving.result()
            write = time.perf_counter() - started - stall
            time.sleep(args.pause)
            store.flush()
            store.close()
            upload, size = done["published"] - started, done["size"]

            plain = boto3.client("s3")  # boto3's defaults, as a hand-written script makes it
            started = time.perf_counter()
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                plain.upload_file(str(f), bucket, f"plain/v{round_}/{f.relative_to(path)}")
            boto = time.perf_counter() - started
            rows.append(dict(size=size, stall=stall, write=write, upload=upload, boto=boto))
            print(f"round {round_}: {size / 2**20:.0f} MiB  stall {stall:.3f} s  write {write:.2f} s  "
                  f"upload {upload:.2f} s ({mib_per_s(size, upload):.0f} MiB/s)  "
                  f"plain boto3 {boto:.2f} s ({mib_per_s(size, boto):.0f} MiB/s)", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    gib = median["size"] / 2**30
    print()
    print(f"checkpoint size                        {median['size'] / 2**20:.0f} MiB")
    print(f"training stall (staging, async save)   {median['stall']:.3f} s  = {median['stall'] / gib:.2f} s per GiB")
    print(f"written behind training                {median['write']:.2f} s")
    print(f"upload, kubetune (background)          {median['upload']:.2f} s  {mib_per_s(median['size'], median['upload']):.0f} MiB/s")
    print(f"upload, plain boto3 upload_file        {median['boto']:.2f} s  {mib_per_s(median['size'], median['boto']):.0f} MiB/s")


if __name__ == "__main__":
    main()
