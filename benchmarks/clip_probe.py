"""What probing a streamed clip fetches before the first step: ranged reads and bytes, against the clip.

    .venv/bin/python benchmarks/clip_probe.py                       # 81 frames, 832x480, H.264 .mp4
    .venv/bin/python benchmarks/clip_probe.py --frames 33 --width 480 --height 320

A video-captions data set streamed from s3:// has every clip probed before training (its frame count
decides its samples and its frame-count bucket). data.video.probe reads a clip not yet on disk through
storage.stream's ranged file: an .mp4 keeps its frame count in its header (the moov box, at its end
as libx264 via PyAV writes it), so the probe reads that and the first frame. Here the ranged reads go
to the clip's bytes in memory and are counted (each is one GET against S3: a round trip), for two
clips: moving shapes over a texture (video_decode.py's, compresses like footage) and noise (large).
The full probe (every packet demuxed: what a clip on disk gets) is run too, to check the counts agree.
A benchmark, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--fps", type=int, default=16)
    return parser.parse_args(argv)


def measure(data: bytes) -> dict:
    from kubetune_trainer.data.video import _probe
    from kubetune_trainer.storage.stream import ranged_file

    reads = []

    def read_range(start: int, size: int) -> bytes:
        reads.append(size)
        return data[start:start + size]

    started = time.perf_counter()
    header = _probe(ranged_file(read_range, len(data)), header_only=True)
    seconds = time.perf_counter() - started
    full = _probe(io.BytesIO(data))
    return {"clip_mb": round(len(data) / 1e6, 2), "ranged_reads": len(reads), "read_mb": round(sum(reads) / 1e6, 2),
            "read_share": round(sum(reads) / len(data), 3), "probe_s": round(seconds, 3),
            "frames": header.frames, "frames_full_probe": full.frames}


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from video_decode import frames_of

    from kubetune_trainer.data.video import write_clip

    rng = np.random.default_rng(0)
    clips = {"shapes": frames_of(0, args.frames, args.width, args.height),
             "noise": [rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8) for _ in range(args.frames)]}
    with tempfile.TemporaryDirectory() as directory:
        for name, frames in clips.items():
            path = write_clip(Path(directory) / f"{name}.mp4", frames, args.fps)
            print(name, measure(path.read_bytes()))


if __name__ == "__main__":
    main()
