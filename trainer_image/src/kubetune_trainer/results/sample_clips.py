"""Validation clips of a video family: each as an H.264 .mp4 and an animated GIF preview, and the GIF
to TensorBoard.

A video family's sample_images returns Clip values instead of PIL images; the validator hands them
here. The .mp4 is the clip as a player shows it; the GIF is what TensorBoard's image dashboard plays
(its image summaries carry encoded bytes, and a GIF's frames animate there; `add_video` would need
moviepy, which the trainer does not install) and what a browser shows of the run's samples/ folder.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

DEFAULT_FPS = 16.0  # Wan's own frame rate: the rate a clip sampled without spec.data.fps plays at


@dataclass(frozen=True)
class Clip:
    frames: list          # PIL images, in order, all of one size
    fps: float = DEFAULT_FPS


def gif_bytes(clip: Clip) -> bytes:
    """The clip as an animated GIF that loops (Pillow's encoder, a palette per frame)."""
    buffer = io.BytesIO()
    first, *rest = [frame.convert("RGB") for frame in clip.frames]
    first.save(buffer, format="GIF", save_all=True, append_images=rest, loop=0,
               duration=max(20, round(1000 / clip.fps)), disposal=1)
    return buffer.getvalue()


def write_clip_files(clip: Clip, folder: Path, name: str) -> list[Path]:
    """NAME.mp4 (H.264) and NAME.gif in FOLDER; returns both."""
    from kubetune_trainer.data.video import write_clip

    frames = [np.asarray(frame.convert("RGB")) for frame in clip.frames]
    height, width = frames[0].shape[:2]
    # H.264's 4:2:0 chroma needs even sides: an odd row or column is dropped (sizes are multiples of 16
    # in the spec, so this only guards a family that renders otherwise).
    frames = [frame[:height - height % 2, :width - width % 2] for frame in frames]
    mp4 = write_clip(folder / f"{name}.mp4", frames, Fraction(clip.fps).limit_denominator(1001))
    gif = folder / f"{name}.gif"
    gif.write_bytes(gif_bytes(clip))
    return [mp4, gif]


def add_gif_to_tensorboard(writer, tag: str, clip: Clip, step: int) -> None:
    """The clip as an animated image summary (TensorBoard plays a GIF's frames)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = clip.frames[0].size
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif_bytes(clip))
    # SummaryWriter has no public call for a pre-encoded image (add_image re-encodes one frame as PNG):
    # its file writer takes the Summary proto as is. Pinned torch; test_family_wan checks the event.
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


def record_clips(clips: list[Clip], folder: Path, writer, step: int) -> list[Path]:
    """Each clip as FOLDER/I.mp4 and I.gif and as TensorBoard's samples/I; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i, clip in enumerate(clips):
        written += write_clip_files(clip, folder, str(i))
        add_gif_to_tensorboard(writer, f"samples/{i}", clip, step)
    return written
