"""What probing a streamed clip fetches before the first step: ranged reads and bytes, against the clip.

    .venv/bin/python benchmarks/clip_probe.py                       # 81 frames, 832x480, H.264 .mp4
    .venv/bin/python benchmarks/clip_probe.py --frames 33 --width 480 --height 320
    .venv/bin/python benchmarks/clip_probe.py --late 241      # + a late sample's decode, seek vs from start

A video-captions data set streamed from s3:// has every clip probed before training (its frame count
decides its samples and its frame-count bucket). data.video.probe reads a clip not yet on disk through
storage.stream's ranged file: an .mp4 keeps its frame count in its header (the moov box, at its end
as libx264 via PyAV writes it), so the probe reads that and the first frame. Here the ranged reads go
to the clip's bytes in memory and are counted (each is one GET against S3: a round trip), for two
clips: moving shapes over a texture (video_decode.py's, compresses like footage) and noise (large).
The full probe (every packet demuxed: what a clip on disk gets) is run too, to check the counts agree.
With --late N: a clip of N frames (the shapes, a keyframe every --gop frames, as web clips have one
every few seconds) probed from its header as above, then the sample of --frames frames that starts
last in it decoded as a loader worker does (data.video.read_frames: decode, resize, crop), once
seeking to the keyframe before the sample on the header's timeline, once from the clip's start (what
a streamed clip did before); the frames are checked equal.
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
    parser.add_argument("--late", type=int, default=0, help="frames of a long clip to time a late sample in")
    parser.add_argument("--gop", type=int, default=48, help="keyframe interval of the --late clip")
    parser.add_argument("--rounds", type=int, default=3)
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


def late_sample(path: Path, frames: int, rounds: int) -> dict:
    """Seconds per sample of the last `frames` frames of the clip at PATH: seeking vs from the start."""
    from kubetune_trainer.data.video import _probe, read_frames
    from kubetune_trainer.storage.stream import ranged_file

    data = path.read_bytes()
    info = _probe(ranged_file(lambda start, size: data[start:start + size], len(data)), header_only=True)
    indices = list(range(info.frames - frames, info.frames))
    size = crop = (info.width, info.height)
    timed = {}
    for name, given in (("from_start_s", None), ("seek_s", info)):
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            kept = read_frames(path, indices, size, (0, 0, *crop), False, given)
            best = min(best, time.perf_counter() - started)
        timed[name] = (round(best, 3), kept)
    same = bool(np.array_equal(timed["seek_s"][1], timed["from_start_s"][1]))
    return {"clip_frames": info.frames, "sample_start": indices[0], "frames": frames,
            "timeline": info.frame_ticks is not None, "from_start_s": timed["from_start_s"][0],
            "seek_s": timed["seek_s"][0], "speedup": round(timed["from_start_s"][0] / timed["seek_s"][0], 2),
            "same_frames": same}


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
        if args.late:
            path = write_clip(Path(directory) / "late.mp4", frames_of(1, args.late, args.width, args.height),
                              args.fps, g=str(args.gop))
            print("late sample", late_sample(path, args.frames, args.rounds))


if __name__ == "__main__":
    main()
