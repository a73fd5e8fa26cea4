"""Training on an s3:// data set streamed, as parquet or WebDataset shards, or copied whole first, vs the
same images on local disk: time to the first step, steady samples/s.

    .venv/bin/python benchmarks/data_streaming.py                 # 20,000 images, the tiny SD1.5
    .venv/bin/python benchmarks/data_streaming.py --images 2000   # a quick look
    .venv/bin/python benchmarks/data_streaming.py --images 4000 --cases all --delay-ms 40

Starts a real S3 server (versitygw, built by devcluster/build.sh) on loopback, writes a captioned
data set of --images JPEGs (--side px, noise, so they weigh what photos weigh) into it, and trains
the tiny SD1.5 on it in each case, each in a fresh cache directory:
  local disk            the same files on local disk (the steady-rate reference);
  copied whole          spec.data.streaming.enabled false: the whole set is copied (and screened) first;
  streamed              the default: one listing, then each step's images fetched ahead of the loader;
  parquet streamed      the same images as Hugging Face datasets writes parquet (--rows-per-file rows a
                        file, row groups of --row-group), spec.data.format parquet;
  webdataset streamed   the same images as WebDataset shards of --rows-per-file samples;
  caption files streamed  the same images with their captions in NAME.txt files beside them (no
                        metadata.jsonl: kohya / ai-toolkit / musubi-tuner folders), streamed.
The default cases are the first three (--cases all: every one). With --delay-ms every S3 request of
the trainers passes a proxy on loopback that holds it that long (benchmarks/delay_proxy.py), as an
object store across a network answers. Time to the first step runs from the trainer's start to its
first step's TensorBoard event; steady samples/s is the median over the steps after --warmup. A
benchmark, not a test: nothing is asserted.
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
from delay_proxy import delay_s3  # noqa: E402

# name: (where the data is, which stored form of it, spec.data.format, streamed)
CASES = {
    "local disk": ("local", "files", "files", True),
    "copied whole": ("s3", "files", "files", False),
    "streamed": ("s3", "files", "files", True),
    "parquet streamed": ("s3", "parquet", "parquet", True),
    "webdataset streamed": ("s3", "webdataset", "webdataset", True),
    "caption files streamed": ("s3", "caption-files", "files", True),
}
DEFAULT_CASES = "local disk;copied whole;streamed"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--side", type=int, default=256, help="image side in pixels (trained at --resolution)")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the steady rate")
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help=f"which cases, separated by ; or 'all' (default {DEFAULT_CASES!r})")
    parser.add_argument("--rows-per-file", type=int, default=500, help="parquet rows / WebDataset samples a file")
    parser.add_argument("--row-group", type=int, default=100, help="parquet rows a row group")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every S3 request of the trainers")
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


def caption_files(data: Path, directory: Path) -> Path:
    """DATA's images again, each with its caption in NAME.txt beside it and no metadata.jsonl."""
    if not directory.is_dir():
        for line in (data / "metadata.jsonl").read_text().splitlines():
            record = json.loads(line)
            image = directory / record["file_name"]
            image.parent.mkdir(parents=True, exist_ok=True)
            os.link(data / record["file_name"], image)  # the same bytes, no second copy on disk
            image.with_suffix(".txt").write_text(record["text"])
    return directory


def run(args, name: str, model: Path, data_uri: str, work: Path) -> dict:
    _, _, data_format, streaming = CASES[name]
    out = work / name.replace(" ", "-")
    shutil.rmtree(out, ignore_errors=True)
    manifest = {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "stream-bench"},
        "spec": {
            "model": {"family": "sd15", "pretrained": str(model)},
            "adapter": {"type": "lora", "rank": 4},
            "data": {"layout": "captions", "uri": data_uri, "format": data_format, "resolution": args.resolution,
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
    """Images per second one process's prefetcher fetches when nothing else runs, one image a step
    (batch 1): the training speed above which streaming, not the model, would set the pace."""
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
    cases = list(CASES) if args.cases == "all" else args.cases.split(";")
    if unknown := set(cases) - set(CASES):
        sys.exit(f"--cases: unknown {sorted(unknown)}; the cases are {list(CASES)}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kubetune-stream-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    from kubetune_trainer.data.restore_data import write_parquet, write_webdataset
    from kubetune_trainer.storage import s3
    from kubetune_trainer.storage.uri import parse_s3
    from kubetune_trainer.models.tiny_models import write_tiny_model

    model = work / "sd15" if (work / "sd15").is_dir() else write_tiny_model("sd15", work / "sd15", seed=0)
    data = work / f"data-{args.images}-{args.side}"
    if not (data / "metadata.jsonl").is_file():
        write_data(data, args.images, args.side)
    forms = {CASES[name][1] for name in cases}
    sets = {"files": data}
    if "parquet" in forms:
        sets["parquet"] = write_parquet("captions", data, work / f"parquet-{args.images}-{args.side}",
                                        args.rows_per_file, args.row_group)
    if "webdataset" in forms:
        sets["webdataset"] = write_webdataset("captions", data, work / f"webdataset-{args.images}-{args.side}",
                                              args.rows_per_file)
    if "caption-files" in forms:
        sets["caption-files"] = caption_files(data, work / f"caption-files-{args.images}-{args.side}")
    size = sum(p.stat().st_size for p in data.rglob("*.jpg"))
    (work / "s3").mkdir(exist_ok=True)
    server, settings = start_versitygw(work / "s3")
    os.environ.update(settings)
    proxy = None
    try:
        s3.forget_clients()
        bucket = "bench-" + secrets.token_hex(4)
        s3.client().create_bucket(Bucket=bucket)
        started = time.time()
        for form, local in sets.items():
            s3.upload_files(sorted(p for p in local.rglob("*") if p.is_file()), local,
                            parse_s3(f"s3://{bucket}/{form}"))
        print(f"{args.images} images of {args.side} px ({size / 1e6:.0f} MB) as {sorted(sets)} uploaded in "
              f"{time.time() - started:.0f} s; tiny SD1.5 at {args.resolution} px, batch {args.batch_size}, "
              f"{args.steps} steps, CPU")
        if args.delay_ms:  # the upload went straight to the server; the trainers go through the delay
            proxy = delay_s3(settings, args.delay_ms)
        results = {}
        for name in cases:
            where, form, _, _ = CASES[name]
            uri = str(sets[form]) if where == "local" else f"s3://{bucket}/{form}"
            results[name] = run(args, name, model, uri, work)
        rate = fetch_rate(f"s3://{bucket}/files", work, min(args.images, 5000)) if "streamed" in cases else None
    finally:
        if proxy is not None:
            proxy.close()
        server.terminate()
        server.wait()
    nan = {"samples_per_s": float("nan"), "first_step_s": float("nan")}
    reference = results.get("local disk", nan)["samples_per_s"]
    copied = results.get("copied whole", nan)["first_step_s"]
    print("| data | time to first step (s) | vs copied whole | steady samples/s | vs local disk |")
    print("|---|---|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {result['first_step_s']:.1f} | {result['first_step_s'] / copied:.3f} | "
              f"{result['samples_per_s']:.2f} | {result['samples_per_s'] / reference:.2f}x |")
    for name, result in results.items():
        print(f"{name}: " + next((line.strip() for line in result["log"].splitlines() if "data stream:" in line), "-"))
    if rate is not None:
        print(f"one process's prefetcher alone: {rate:.0f} images/s ({rate * size / args.images / 1e6:.1f} MB/s), "
              f"{rate / reference:.0f}x what this training consumes")


if __name__ == "__main__":
    main()
