"""Checkpoint I/O: what a checkpoint costs training, and how fast it reaches S3.

    .venv/bin/python benchmarks/checkpoint_io.py                 # 256 MiB checkpoint, 3 rounds
    .venv/bin/python benchmarks/checkpoint_io.py --size-mib 1024 --rounds 5

Starts a real S3 server (versitygw, built by devcluster/build.sh) on loopback and writes a
checkpoint shaped like a LoRA run's (adapter in safetensors, AdamW state twice its size with
torch.save, the published adapter, per-rank RNG files), then measures per round:
  save     serialising it to local disk: training waits for this;
  enqueue  handing it to the background uploader: training waits for this too;
  upload   in the background: the manifest (sizes + sha256), then kubetune's upload (parallel
           files, multipart, manifest last);
  boto3    the same files with a plain sequential boto3 `upload_file` each, default settings —
           what a hand-written sync does (for throughput only; nothing orders its manifest).
The stall per checkpoint is save + enqueue with background uploads, against save + upload when
the manifest and upload are inline. Medians are printed (a benchmark, not a test: nothing is asserted).
"""
from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import save_file


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="total checkpoint size (approximately)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of starting versitygw (AWS_* env "
                        "credentials; creates a bucket)")
    return parser.parse_args(argv)


def start_versitygw(root: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    from kubetune_dev import versions

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
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


def adapter_tensors(size_mib: int) -> dict[str, torch.Tensor]:
    """Weights for a checkpoint of about size_mib: adapter S, optimizer 2S, published adapter S."""
    generator = torch.Generator().manual_seed(0)
    elements = 4 * 1024 * 1024  # 16 MiB of fp32 per tensor
    return {f"lora.{i}": torch.randn(elements, generator=generator) for i in range(max(1, size_mib // 4 // 16))}


def write_checkpoint(path: Path, adapter: dict[str, torch.Tensor], step: int) -> None:
    """What the trainer's save does on the training thread, shaped like a LoRA run's checkpoint."""
    path.mkdir(parents=True)
    save_file(adapter, path / "trainable.safetensors")
    torch.save({"state": {i: {"exp_avg": t, "exp_avg_sq": t.clone()} for i, t in enumerate(adapter.values())}},
               path / "optimizer.pt")
    save_file(adapter, path / "pytorch_lora_weights.safetensors")
    for rank in range(8):
        torch.save({"torch": torch.get_rng_state()}, path / f"rng-rank{rank}.pt")


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

    from kubetune_trainer.storage import s3
    from kubetune_trainer.storage.checkpoint_store import CheckpointStore

    s3.client.cache_clear()
    bucket = "bench-" + secrets.token_hex(4)
    s3.client().create_bucket(Bucket=bucket)
    rows = []
    adapter = adapter_tensors(args.size_mib)  # made once: only the writing is timed
    try:
        for round_ in range(1, args.rounds + 1):
            done = {}
            store = CheckpointStore(f"s3://{bucket}/runs/bench/job/v{round_}", staging=work / "staging",
                                    on_published=lambda step, seconds, size: done.update(seconds=seconds))
            path = store.local / f"checkpoint-{round_}"
            started = time.perf_counter()
            write_checkpoint(path, adapter, round_)
            save = time.perf_counter() - started
            started = time.perf_counter()
            size = store.publish_checkpoint(path, round_, 0, 0.1, keep_last=10)
            enqueue = time.perf_counter() - started
            store.flush()
            store.close()
            upload = done["seconds"]

            plain = boto3.client("s3")  # boto3's defaults, as a hand-written script makes it
            started = time.perf_counter()
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                plain.upload_file(str(f), bucket, f"plain/v{round_}/{f.relative_to(path)}")
            boto = time.perf_counter() - started
            rows.append(dict(size=size, save=save, enqueue=enqueue, upload=upload, boto=boto))
            print(f"round {round_}: {size / 2**20:.0f} MiB  save {save:.2f} s  enqueue {enqueue * 1000:.2f} ms  "
                  f"upload {upload:.2f} s ({mib_per_s(size, upload):.0f} MiB/s)  "
                  f"plain boto3 {boto:.2f} s ({mib_per_s(size, boto):.0f} MiB/s)", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print()
    print(f"checkpoint size                        {median['size'] / 2**20:.0f} MiB")
    print(f"upload, kubetune (background)          {median['upload']:.2f} s  {mib_per_s(median['size'], median['upload']):.0f} MiB/s")
    print(f"upload, plain boto3 upload_file        {median['boto']:.2f} s  {mib_per_s(median['size'], median['boto']):.0f} MiB/s")
    print(f"training stall, background upload      {median['save'] + median['enqueue']:.2f} s  (save {median['save']:.2f} s + enqueue {median['enqueue'] * 1000:.1f} ms)")
    print(f"training stall, inline upload          {median['save'] + median['upload']:.2f} s")


if __name__ == "__main__":
    main()
