"""Video clips decoded per loader worker: can the video-captions layout keep a slow video step fed?

    .venv/bin/python benchmarks/video_decode.py                    # 81 frames, 832x480, H.264
    .venv/bin/python benchmarks/video_decode.py --frames 33 --width 480 --height 320 --workers 2

Writes a few H.264 .mp4 clips first (PyAV's libx264 at its default preset and quality: moving shapes
over a textured background, so the decoder does the usual work), then times the layout's own
sample path (kubetune_trainer.data.layouts: screen, data set, item) at the clips' size:
  - one process, one thread (what one DataLoader worker does): clips/s, split into decoding + resize
    (PyAV) and the float tensor in [-1, 1];
  - a DataLoader with --workers worker processes over the same samples (this machine's cores);
  - what the embedding cache adds per sample (the content hash of its key, data.cache).
Then says whether 4 workers keep a training step of --step-seconds fed at --batch clips per step
(Wan 14B at 81x480p: about 10 s a step on one H200), and by what margin, assuming one core per
worker. A benchmark, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the clips per measurement")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers measured here")
    parser.add_argument("--step-seconds", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=1, help="clips per training step per GPU")
    return parser.parse_args(argv)


def frames_of(index: int, count: int, width: int, height: int) -> list[np.ndarray]:
    """A textured background panning (gradients, fixed texture, fresh grain each frame) with two
    shapes crossing it: about the bitrate of a 480p clip from the web (~1-2 Mbit/s)."""
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:height, 0:width]
    background = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 127 // (width + height))], -1)
    background = (background + rng.integers(0, 40, (height, width, 3))).clip(0, 215).astype(np.uint8)
    frames = []
    for t in range(count):
        frame = np.roll(background, 3 * t, axis=1) + rng.integers(0, 20, (height, width, 3), dtype=np.uint8)
        cx, cy = (40 + 6 * t + 30 * index) % width, height // 3
        frame[max(0, cy - 40):cy + 40, max(0, cx - 40):cx + 40] = (220, 40, 40)
        r = (y - 2 * height // 3) ** 2 + (x - (width - 1 - (8 * t) % width)) ** 2 < 50 ** 2
        frame[r] = (40, 80, 220)
        frames.append(frame)
    return frames


def write_clips(root: Path, args) -> float:
    from kubetune_trainer.data.video import write_clip

    began = time.perf_counter()
    lines = []
    for index in range(args.clips):
        name = f"{index:04d}.mp4"
        write_clip(root / name, frames_of(index, args.frames, args.width, args.height), args.fps)
        lines.append(json.dumps({"file_name": name, "text": f"clip {index}"}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return time.perf_counter() - began


def build_dataset(root: Path, args):
    from kubetune_api.rules import SKIP_RULES
    from kubetune_api.spec import TrainingJobSpec
    from kubetune_trainer.data.images import ImageTransform
    from kubetune_trainer.data.layouts import LAYOUTS
    from kubetune_trainer.data.screening import Screen

    spec = TrainingJobSpec.model_validate({  # the layout alone, its rules left out: no model is loaded
        "model": {"family": "sd15", "pretrained": "/none"},
        "data": {"layout": "video-captions", "uri": str(root), "frames": args.frames,
                 "resolution": [args.width, args.height]},
        "training": {"maxSteps": 1}, "checkpoints": {"uri": "/none"}}, context={SKIP_RULES: True})
    layout = LAYOUTS["video-captions"]
    screen = Screen(False, layout.check(spec))
    began = time.perf_counter()
    samples = screen.images(layout.read(spec, screen))
    screened = time.perf_counter() - began
    return layout, layout.dataset(samples, ImageTransform(spec.size), spec, True), screened


def one_worker(dataset, args) -> dict:
    """Items in this process, one thread: decode + resize (PyAV), then the tensor."""
    from kubetune_trainer.data.video import read_frames
    from kubetune_trainer.data.images import cover_size

    torch.set_num_threads(1)
    decode = total = 0.0
    count = 0
    for epoch in range(args.rounds):
        for index in range(len(dataset)):
            info = dataset.clips[index]
            began = time.perf_counter()
            read_frames(dataset.samples[index].path, list(range(args.frames)),
                        cover_size((info.width, info.height), args.width, args.height),
                        (0, 0, args.width, args.height), False)
            decode += time.perf_counter() - began
            began = time.perf_counter()
            item = dataset[(epoch, index)]
            total += time.perf_counter() - began
            count += 1
    return {"clips_per_s": count / total, "decode_s": decode / count, "item_s": total / count,
            "shape": tuple(item["pixel_values"].shape), "bytes": item["pixel_values"].numel() * 4}


def loader(dataset, layout, args) -> float:
    keys = [[(epoch, index)] for epoch in range(args.rounds * 2) for index in range(len(dataset))]
    batches = torch.utils.data.DataLoader(dataset, batch_sampler=keys, collate_fn=layout.collate,
                                          num_workers=args.workers)
    iterator = iter(batches)
    next(iterator)  # the workers started and warm
    began = time.perf_counter()
    count = sum(1 for _ in iterator)
    return count / (time.perf_counter() - began)


def cache_key_seconds(dataset) -> float:
    from kubetune_trainer.data.cache import content_hash

    pixels = dataset[(0, 0)]["pixel_values"]
    began = time.perf_counter()
    content_hash(pixels)
    return time.perf_counter() - began


def main(argv=None) -> None:
    import av

    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kubetune-video-") as tmp:
        root = Path(tmp)
        written = write_clips(root, args)
        size = sum(p.stat().st_size for p in root.glob("*.mp4")) / args.clips
        print(f"PyAV {av.__version__}: {args.clips} H.264 clips of {args.frames} frames at {args.width}x{args.height}, "
              f"{args.fps} fps, {size / 1e6:.2f} MB each (written in {written:.1f} s)")
        layout, dataset, screened = build_dataset(root, args)
        print(f"screening (probe: demux every packet, decode the first frame): {screened / args.clips * 1e3:.0f} ms "
              "a clip")
        single = one_worker(dataset, args)
        print(f"one worker (one process, one thread): {single['clips_per_s']:.2f} clips/s; a sample "
              f"{single['item_s']:.2f} s, of which decode + resize {single['decode_s']:.2f} s; "
              f"pixel_values {list(single['shape'])} float32, {single['bytes'] / 1e6:.0f} MB")
        parallel = loader(dataset, layout, args)
        print(f"DataLoader, {args.workers} workers on this machine: {parallel:.2f} clips/s")
        print(f"embedding cache key (content hash of one sample): {cache_key_seconds(dataset):.2f} s")
        needed = args.batch / args.step_seconds
        four = 4 * single["clips_per_s"]
        print(f"4 workers (one core each): {four:.2f} clips/s against {needed:.2f} clips/s needed by a "
              f"{args.step_seconds:g} s step of {args.batch} clip(s): {'fed' if four >= needed else 'NOT fed'}, "
              f"margin {four / needed:.0f}x (a batch every {args.batch / four:.2f} s on average; one clip takes a "
              f"worker {single['item_s']:.2f} s)")


if __name__ == "__main__":
    main()
