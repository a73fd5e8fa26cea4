"""Time to the first batch for video clips streamed from S3 vs copied whole (the video-captions layout).

    .venv/bin/python benchmarks/clip_streaming.py                        # 200 clips of 81 frames, 832x480
    .venv/bin/python benchmarks/clip_streaming.py --clips 40 --delay-ms 40

One H.264 .mp4 of --frames frames (benchmarks/video_decode.py's moving shapes over a texture, a web
clip's bitrate) is written once and uploaded --clips times under different names with a caption each
(the timings are of requests and bytes, which copies of one clip measure as well as different clips),
to a real S3 server (versitygw on loopback, as data_formats.py). Each case runs in a process of its
own with a fresh cache and does what a trainer process does with the data before its first step,
without the model: lay out (copy whole, or open the stream), read the samples, screen (probe) every
clip where run.Run.set_up does (copied whole; streamed only where the sampler needs the clips' facts
before the first step: --bucketing, or spec.data.skipBad), build the data set, plan the prefetcher,
then load the
first --batches batches of one sample (--frames frames at --resolution px) as run.py loads them
(loop.iterate_steps: the first step in the case's process, then --workers loader workers). Printed:
each phase's end from the case's start (imports excluded), and the ratio of the first batch streamed to copied whole. A benchmark, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import start_versitygw  # noqa: E402  (the same loopback S3 server)

CASES = {"clips, s3 copied whole": False, "clips, s3 streamed": True}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=200)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bucketing", action="store_true",
                        help="spec.data.bucketing: streamed clips then probed before the first step too")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every S3 request of the cases")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, in its own process
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load(args) -> dict:
    """One case: what a trainer process does with its clips up to its first --batches batches."""
    from kubetune_api.spec import TrainingJobSpec
    from kubetune_trainer.data.images import ImageTransform
    from kubetune_trainer.data.layouts import LAYOUTS
    from kubetune_trainer.data.sampler import epoch_steps
    from kubetune_trainer.data.screening import Screen, image_paths
    from kubetune_trainer.loop import iterate_steps
    from kubetune_trainer.run import with_local_inputs
    from kubetune_trainer.storage.stream import Prefetcher, streamed

    started = time.time()
    phases = {}

    def mark(phase: str) -> None:
        phases[phase] = round(time.time() - started, 2)

    layout = LAYOUTS["video-captions"]
    spec = TrainingJobSpec.model_validate({
        "model": {"family": "wan", "pretrained": "/models/none"},
        "data": {"layout": "video-captions", "uri": args.uri, "resolution": args.resolution, "frames": args.frames,
                 "numWorkers": args.workers, "streaming": {"enabled": CASES[args.case]},
                 "bucketing": args.bucketing},
        "training": {"maxSteps": args.batches, "batchSize": 1}, "checkpoints": {"uri": "/runs"}})
    spec = with_local_inputs(spec)
    mark("lay out (copy whole, or open the stream)")
    screen = Screen(skip_bad=False, check=layout.check(spec))
    samples = layout.read_samples(spec, screen)
    if not CASES[args.case] or layout.screen_streamed(spec):  # as run.Run.set_up decides
        samples = screen.images(samples)  # every clip probed (the screen's clip check)
    mark("read and screen (probe every clip where screened)")
    dataset = layout.dataset(samples, ImageTransform(args.resolution), spec, True)
    steps = epoch_steps(len(dataset), 1, seed=0, epoch=0)[:args.batches]
    stream = streamed(Path(spec.data.uri))
    prefetcher = None
    if stream is not None:
        prefetcher = Prefetcher(4 << 30, spec.data.streaming.prefetch_steps, first_step_alone=True)  # as run.py
        prefetcher.plan([[p for _, i in keys for p in image_paths(dataset.samples[i])] for keys in steps])
    mark("data set and prefetch plan")
    # As run.py loads an epoch (one micro-batch a step): its first step in this process, then workers.
    for number, _ in enumerate(iterate_steps(dataset, layout.collate, args.workers, [[keys] for keys in steps],
                                             loader_seed=0)):
        if number == 0:
            mark("first batch")
        if prefetcher is not None:
            prefetcher.advance()
    mark(f"{args.batches} batches")
    if prefetcher is not None:
        prefetcher.close()
    return {"first_batch_s": phases["first batch"], "phases": phases,
            "fetched_mb": round((stream.fetched_bytes if stream else 0) / 1e6, 1)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(load(args)))
        return
    from video_decode import frames_of

    from kubetune_trainer.data.video import write_clip
    from kubetune_trainer.storage import s3
    from kubetune_trainer.storage.uri import parse_s3

    work = Path(tempfile.mkdtemp(prefix="kubetune-clip-stream-bench-"))
    data = work / "clips"
    (data / "videos").mkdir(parents=True)
    clip = write_clip(work / "clip.mp4", frames_of(0, args.frames, args.width, args.height), 16).read_bytes()
    lines = []
    for index in range(args.clips):
        (data / "videos" / f"{index:05d}.mp4").write_bytes(clip)
        lines.append(json.dumps({"file_name": f"videos/{index:05d}.mp4", "text": f"clip {index}"}))
    (data / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    (work / "s3").mkdir()
    server, settings = start_versitygw(work / "s3")
    os.environ.update(settings)
    results = {}
    try:
        s3.forget_clients()
        bucket = "bench-" + secrets.token_hex(4)
        s3.client().create_bucket(Bucket=bucket)
        s3.upload_files(sorted(p for p in data.rglob("*") if p.is_file()), data, parse_s3(f"s3://{bucket}/clips"))
        print(f"{args.clips} clips of {len(clip) / 1e6:.2f} MB ({args.frames} frames, {args.width}x{args.height}, "
              f"H.264), {args.clips * len(clip) / 1e6:.0f} MB; batches of 1 at {args.resolution} px, "
              f"{args.workers} loader workers")
        if args.delay_ms:  # the upload went straight to the server; the cases go through the delay
            from delay_proxy import delay_s3

            delay_s3(settings, args.delay_ms)
        for name in CASES:
            env = {**os.environ, "KUBETUNE_CACHE_DIR": str(work / "cache" / name.replace(" ", "-").replace(",", ""))}
            command = [sys.executable, __file__, "--case", name, "--uri", f"s3://{bucket}/clips"]
            for option in ("frames", "resolution", "batches", "workers"):
                command += [f"--{option}", str(getattr(args, option))]
            command += ["--bucketing"] if args.bucketing else []
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
            results[name] = json.loads(result.stdout.splitlines()[-1])
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work)  # the clips, their S3 copy and each case's cache: a few hundred MB
    copied = results["clips, s3 copied whole"]["first_batch_s"]
    for name, result in results.items():
        print(f"{name}: first batch {result['first_batch_s']:.1f} s ({result['first_batch_s'] / copied:.2f} of "
              f"copied whole), read from S3 by the main process {result['fetched_mb']} MB; phases {result['phases']}")


if __name__ == "__main__":
    main()
