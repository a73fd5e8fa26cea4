"""Streaming an s3:// data set vs copying it whole first: time to the first step, steady samples/s.

    .venv/bin/python benchmarks/data_streaming.py                 # 20,000 images, the tiny SD1.5
    .venv/bin/python benchmarks/data_streaming.py --images 2000   # a quick look

Starts a real S3 server (versitygw, built by devcluster/build.sh) on loopback, writes a captioned
data set of --images JPEGs (--side px, noise, so they weigh what photos weigh) into it, and trains
the tiny SD1.5 on it three ways, each in a fresh cache directory:
  local disk   the same files on local disk (the steady-rate reference);
  copied       spec.data.streaming.enabled false: the whole set is copied (and screened) first;
  streamed     the default: one listing, then each step's images fetched ahead of the loader.
Time to the first step runs from the trainer's start to its first step's TensorBoard event; steady
samples/s is the median over the steps after --warmup. A benchmark, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import start_versitygw  # noqa: E402  (the same loopback S3 server)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--side", type=int, default=256, help="image side in pixels (trained at --resolution)")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the steady rate")
    parser.add_argument("--workdir", type=Path, help="keep data and runs here (default: a temporary directory)")
    return parser.parse_args(argv)


def write_data(directory: Path, count: int, side: int) -> Path:
    """COUNT captioned noise JPEGs (about what a photo of that size weighs) and metadata.jsonl."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    base = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    lines = []
    for i in range(count):
        name = f"{i // 1000:02d}/{i:06d}.jpg"
        (directory / name).parent.mkdir(exist_ok=True)
        shifted = np.roll(base, shift=(i * 7) % side, axis=1)  # each image different, cheap to make
        Image.fromarray(shifted).save(directory / name, quality=90)
        lines.append(json.dumps({"file_name": name, "text": f"a noisy picture number {i}"}))
    (directory / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def run(args, name: str, model: Path, data_uri: str, work: Path, streaming: bool) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    manifest = {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "stream-bench"},
        "spec": {
            "model": {"family": "sd15", "pretrained": str(model)},
            "adapter": {"type": "lora", "rank": 4},
            "data": {"layout": "captions", "uri": data_uri, "resolution": args.resolution,
                     "streaming": {"enabled": streaming}},
            "training": {"maxSteps": args.steps, "batchSize": args.batch_size, "learningRate": 1e-4},
            "checkpoints": {"uri": str(out / "runs"), "everySteps": 10_000_000},
            "resources": {"gpusPerNode": 0},
        },
    }
    config = out.with_suffix(".yaml")
    out.mkdir(parents=True)
    config.write_text(yaml.safe_dump(manifest))
    env = {**os.environ, "KUBETUNE_CACHE_DIR": str(out / "cache"), "KUBETUNE_STAGING_DIR": str(out / "staging")}
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "kubetune_trainer", "--config", str(config)],
                            env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
    times = step_times(out / "runs" / "default" / "stream-bench" / "v0" / "logs")
    steady = times[args.warmup - 1:]
    return {"first_step_s": times[0] - started,
            "samples_per_s": args.batch_size / statistics.median(b - a for a, b in zip(steady, steady[1:])),
            "log": result.stderr}


def fetch_rate(uri: str, work: Path, images: int) -> float:
    """Images per second one process's prefetcher fetches when nothing else runs: the training
    speed above which streaming, not the model, would set the pace."""
    from kubetune_trainer.storage import stream

    os.environ["KUBETUNE_CACHE_DIR"] = str(work / "fetch-rate")
    root = Path(stream.open_stream(uri))
    paths = sorted(root.rglob("*.jpg"))[:images]
    prefetcher = stream.Prefetcher(budget=1 << 40, ahead_steps=len(paths))
    started = time.time()
    prefetcher.plan([[path] for path in paths])
    while prefetcher.fetched < len(paths):
        time.sleep(0.01)
    seconds = time.time() - started
    prefetcher.close()
    return len(paths) / seconds


def step_times(log_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    return [e.wall_time for e in sorted(events.Scalars("train/loss"), key=lambda e: e.step)]


def main(argv=None) -> None:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kubetune-stream-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    from kubetune_trainer.storage import s3
    from kubetune_trainer.storage.uri import parse_s3
    from kubetune_trainer.tiny_models import write_tiny_model

    model = work / "sd15" if (work / "sd15").is_dir() else write_tiny_model("sd15", work / "sd15", seed=0)
    data = work / f"data-{args.images}-{args.side}"
    if not (data / "metadata.jsonl").is_file():
        write_data(data, args.images, args.side)
    size = sum(p.stat().st_size for p in data.rglob("*.jpg"))
    (work / "s3").mkdir(exist_ok=True)
    server, settings = start_versitygw(work / "s3")
    os.environ.update(settings)
    try:
        s3.forget_clients()
        bucket = "bench-" + secrets.token_hex(4)
        s3.client().create_bucket(Bucket=bucket)
        started = time.time()
        s3.upload_files(sorted(p for p in data.rglob("*") if p.is_file()), data, parse_s3(f"s3://{bucket}/set"))
        print(f"{args.images} images of {args.side} px ({size / 1e6:.0f} MB) uploaded in {time.time() - started:.0f} s; "
              f"tiny SD1.5 at {args.resolution} px, batch {args.batch_size}, {args.steps} steps, CPU")
        results = {"local disk": run(args, "local", model, str(data), work, True),
                   "copied whole": run(args, "copied", model, f"s3://{bucket}/set", work, False),
                   "streamed": run(args, "streamed", model, f"s3://{bucket}/set", work, True)}
        rate = fetch_rate(f"s3://{bucket}/set", work, min(args.images, 5000))
    finally:
        server.terminate()
        server.wait()
    print("| data | time to first step (s) | steady samples/s | vs local disk |")
    print("|---|---|---|---|")
    reference = results["local disk"]["samples_per_s"]
    for name, result in results.items():
        print(f"| {name} | {result['first_step_s']:.1f} | {result['samples_per_s']:.1f} | "
              f"{result['samples_per_s'] / reference:.2f}x |")
    streamed, copied = results["streamed"], results["copied whole"]
    print(f"streamed first step / copied first step: {streamed['first_step_s'] / copied['first_step_s']:.3f}")
    print(next((line for line in streamed["log"].splitlines() if "data stream:" in line), ""))
    print(f"one process's prefetcher alone: {rate:.0f} images/s ({rate * size / args.images / 1e6:.1f} MB/s), "
          f"{rate / reference:.0f}x what this training consumes")


if __name__ == "__main__":
    main()
