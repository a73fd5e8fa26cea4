"""The data loader on parquet files and WebDataset shards streamed from S3 vs the same images as loose
files: time to the first batch and steady samples/s.

    .venv/bin/python benchmarks/data_formats.py                  # 4,000 images of 256 px
    .venv/bin/python benchmarks/data_formats.py --images 800     # a quick look
    .venv/bin/python benchmarks/data_formats.py --delay-ms 40    # every S3 request 40 ms later

Starts a real S3 server (versitygw, built by devcluster/build.sh) on loopback and writes one captioned
data set of --images JPEGs (noise, so they weigh what photos weigh) three ways: loose files with
metadata.jsonl, parquet as Hugging Face datasets writes it (--rows-per-file rows a file, row groups of
--row-group, datasets' default for images) and WebDataset shards (--rows-per-file samples each), all
uploaded. Each case runs in a process of its own with a fresh cache directory and does what a
trainer process does before and during training, without the model: lay out (or copy) the data, read
its samples, screen them where they are not streamed, plan the prefetcher, then load --steps batches
of --batch-size as run.py loads them (loop.iterate_steps: the first step in the case's process, then
--workers loader workers; decoded and transformed to --resolution px). Time to the first batch runs from the case's start; steady samples/s is over
the batches after --warmup. With --delay-ms the cases reach the server through a proxy on loopback
that holds every request that long (benchmarks/delay_proxy.py), as an object store across a network
answers. A benchmark, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import start_versitygw  # noqa: E402  (the same loopback S3 server)
from delay_proxy import delay_s3  # noqa: E402
from data_streaming import write_data  # noqa: E402  (the same noise JPEGs)

# name: (where the data is, spec.data.format, streamed)
CASES = {
    "loose, local disk": ("local", "files", True),
    "loose, s3 copied whole": ("s3", "files", False),
    "loose, s3 streamed": ("s3", "files", True),
    "parquet, s3 streamed": ("s3", "parquet", True),
    "webdataset, s3 streamed": ("s3", "webdataset", True),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--side", type=int, default=256, help="image side in pixels")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10, help="batches left out of the steady rate")
    parser.add_argument("--workers", type=int, default=2, help="spec.data.numWorkers")
    parser.add_argument("--rows-per-file", type=int, default=500)
    parser.add_argument("--row-group", type=int, default=100)
    parser.add_argument("--cases", default=";".join(CASES),
                        help="which cases, separated by ; (default all; the ratios need the first two)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every S3 request of the cases")
    parser.add_argument("--prefetch-steps", type=int, default=None,
                        help="spec.data.streaming.prefetchSteps (default: the spec's)")
    parser.add_argument("--workdir", type=Path, help="keep data here (default: a temporary directory)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, in its own process
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load(args) -> dict:
    """One case: what a trainer process does with its data, up to --steps batches."""
    from kubetune_api.spec import TrainingJobSpec
    from kubetune_trainer.data.captions import CaptionsDataset, collate
    from kubetune_trainer.data.images import ImageTransform
    from kubetune_trainer.data.layouts import LAYOUTS
    from kubetune_trainer.data.sampler import epoch_steps
    from kubetune_trainer.data.screening import Screen, image_paths
    from kubetune_trainer.loop import iterate_steps
    from kubetune_trainer.run import with_local_inputs
    from kubetune_trainer.storage.members import MEMBERS
    from kubetune_trainer.storage.stream import Prefetcher, streamed

    started = time.time()
    _, data_format, streaming = CASES[args.case]
    spec = TrainingJobSpec.model_validate({
        "model": {"family": "sd15", "pretrained": "/models/none"},
        "data": {"layout": "captions", "uri": args.uri, "format": data_format, "resolution": args.resolution,
                 "numWorkers": args.workers,
                 "streaming": {"enabled": streaming, **({"prefetchSteps": args.prefetch_steps}
                                                        if args.prefetch_steps else {})}},
        "training": {"maxSteps": args.steps, "batchSize": args.batch_size}, "checkpoints": {"uri": "/runs"}})
    phases = {}  # where the first batch's time goes: each phase's end, from the case's start

    def mark(phase: str) -> None:
        phases[phase] = round(time.time() - started, 2)

    spec = with_local_inputs(spec)
    mark("lay out (open the stream, or copy whole)")
    screen = Screen(skip_bad=False)
    samples = LAYOUTS["captions"].read_samples(spec, screen)
    stream = streamed(Path(spec.data.uri))
    if stream is None:
        samples = screen.images(samples)  # as the trainer does before training data it does not stream
    mark("read the samples (index containers, screen)")
    dataset = CaptionsDataset(samples, ImageTransform(args.resolution), 0.0, seed=0)
    steps = epoch_steps(len(dataset), args.batch_size, seed=0, epoch=0)[:args.steps]
    prefetcher = None
    if stream is not None:
        prefetcher = Prefetcher(4 << 30, spec.data.streaming.prefetch_steps, first_step_alone=True)  # as run.py
        prefetcher.plan([[p for _, i in keys for p in image_paths(dataset.samples[i])] for keys in steps])
    mark("data set and prefetch plan")
    times = []
    # As run.py loads an epoch (one micro-batch a step): its first step in this process, then workers.
    for _ in iterate_steps(dataset, collate, args.workers, [[keys] for keys in steps], loader_seed=0):
        times.append(time.time())
        if len(times) == 1:
            mark("first batch")
        if prefetcher is not None:
            prefetcher.advance()
    if prefetcher is not None:
        prefetcher.close()
    steady = times[args.warmup:]
    # What this process (its prefetcher, mostly) read from S3: whole objects and ranges of containers.
    fetched = (stream.fetched_bytes if stream else 0) + MEMBERS.ranged_bytes
    return {"first_batch_s": times[0] - started,
            "samples_per_s": args.batch_size * (len(steady) - 1) / (steady[-1] - steady[0]),
            "fetched_mb": fetched / 1e6, "phases": phases}


def run_case(args, name: str, uri: str, work: Path) -> dict:
    cache = work / "cache" / name.replace(" ", "-").replace(",", "")
    env = {**os.environ, "KUBETUNE_CACHE_DIR": str(cache)}
    command = [sys.executable, __file__, "--case", name, "--uri", uri]
    for option in ("resolution", "batch_size", "steps", "warmup", "workers", "prefetch_steps"):
        if getattr(args, option) is not None:
            command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(load(args)))
        return
    from kubetune_trainer.data.restore_data import write_parquet, write_webdataset
    from kubetune_trainer.storage import s3
    from kubetune_trainer.storage.uri import parse_s3

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kubetune-formats-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    loose = work / f"loose-{args.images}-{args.side}"
    if not (loose / "metadata.jsonl").is_file():
        write_data(loose, args.images, args.side)
    sets = {"files": loose,
            "parquet": write_parquet("captions", loose, work / "parquet", args.rows_per_file, args.row_group),
            "webdataset": write_webdataset("captions", loose, work / "webdataset", args.rows_per_file)}
    size = sum(p.stat().st_size for p in loose.rglob("*.jpg"))
    (work / "s3").mkdir(exist_ok=True)
    server, settings = start_versitygw(work / "s3")
    os.environ.update(settings)
    try:
        s3.forget_clients()
        bucket = "bench-" + secrets.token_hex(4)
        s3.client().create_bucket(Bucket=bucket)
        for name, local in sets.items():
            s3.upload_files(sorted(p for p in local.rglob("*") if p.is_file()), local, parse_s3(f"s3://{bucket}/{name}"))
        print(f"{args.images} JPEGs of {args.side} px ({size / 1e6:.0f} MB); parquet files of {args.rows_per_file} rows "
              f"in row groups of {args.row_group}, shards of {args.rows_per_file} samples; batches of {args.batch_size} "
              f"at {args.resolution} px, {args.workers} loader workers, {args.steps} batches")
        if args.delay_ms:  # the upload went straight to the server; the cases go through the delay
            delay_s3(settings, args.delay_ms)
        results = {}
        for name, (where, data_format, _) in CASES.items():
            if name not in args.cases.split(";"):
                continue
            uri = str(sets[data_format]) if where == "local" else f"s3://{bucket}/{data_format}"
            results[name] = run_case(args, name, uri, work)
    finally:
        server.terminate()
        server.wait()
    nan = {"samples_per_s": float("nan"), "first_batch_s": float("nan")}
    reference = results.get("loose, local disk", nan)["samples_per_s"]
    copied = results.get("loose, s3 copied whole", nan)["first_batch_s"]
    print("| data | first batch (s) | vs copied whole | steady samples/s | vs local files | read from S3 by the main process (MB) |")
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {result['first_batch_s']:.1f} | {result['first_batch_s'] / copied:.2f} | "
              f"{result['samples_per_s']:.0f} | {result['samples_per_s'] / reference:.2f}x | {result['fetched_mb']:.0f} |")
    for name, result in results.items():  # where each case's first batch went (each phase's end, s)
        print(f"{name}: {result['phases']}")


if __name__ == "__main__":
    main()
