"""`kubetune evaluate` for a video family: each generated clip against its held-out clip, frame by frame.

Frame i of a generated clip is compared with the held-out clip's frame at the same position at
spec.data.fps (its own frames when unset: what training reads), over the frames both hold:
- ssim: the mean of the frames' SSIM (evaluation.ssim, the reference frame resized to the generated size);
- clip_image: the mean of the frames' cos(E_img(generated), E_img(reference));
- clip_text: the mean over the generated frames of cos(E_img(frame), E_txt(caption)).
Each clip is written as clips/NNNN.mp4 (H.264) with its GIF preview beside it (sample_clips).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from kubetune_trainer.results.evaluation import Scores, ssim
from kubetune_trainer.results.sample_clips import Clip, write_clip_files


def reference_frames(path: Path, count: int, fps: float | None) -> list:
    """The first `count` frames the clip holds at `fps` (fewer if it is shorter), as PIL images at its size."""
    from PIL import Image

    from kubetune_trainer.data.video import probe, read_frames

    info = probe(path)
    indices = [info.source_index(position, fps) for position in range(min(count, info.positions(fps)))]
    frames = read_frames(path, indices, (info.width, info.height), (0, 0, info.width, info.height), False, info)
    return [Image.fromarray(frame) for frame in frames]


def per_clip(scores: Scores, lengths: list[int]) -> Scores:
    """Per-frame scores of consecutive clips (`lengths` frames each) as each clip's mean."""
    means, start = [], 0
    for length in lengths:
        means.append(sum(scores.per_image[start:start + length]) / length)
        start += length
    return Scores(means)


def clip_scores(generated: list[Clip], references: list[list], prompts: list[str], clip) -> dict[str, Scores]:
    """ssim (and with a CLIP scorer clip_image, clip_text) of each generated clip, averaged over its frames."""
    pairs = [list(zip(clip_.frames, reference)) for clip_, reference in zip(generated, references)]
    if any(not frames for frames in pairs):
        raise ValueError("a held-out clip holds no frame to compare")
    ours = [frame.convert("RGB") for frames in pairs for frame, _ in frames]
    theirs = [reference for frames in pairs for _, reference in frames]
    lengths = [len(frames) for frames in pairs]
    scores = {"ssim": per_clip(ssim(ours, theirs), lengths)}
    if clip is not None:
        scores["clip_image"] = per_clip(clip.image_similarity(ours, theirs), lengths)
        every_frame = [frame.convert("RGB") for clip_ in generated for frame in clip_.frames]
        captions = [prompt for clip_, prompt in zip(generated, prompts) for _ in clip_.frames]
        scores["clip_text"] = per_clip(clip.text_similarity(every_frame, captions),
                                       [len(clip_.frames) for clip_ in generated])
    return scores


def clip_files(generated: list[Clip]) -> dict[str, bytes]:
    """clips/NNNN.mp4 and .gif of each clip, encoded in a scratch folder and read back (the evaluation
    writes nothing until every file is ready)."""
    files = {}
    with tempfile.TemporaryDirectory(prefix="kubetune-clips-") as scratch:
        for i, clip_ in enumerate(generated):
            for path in write_clip_files(clip_, Path(scratch), f"{i:04d}"):
                files[f"clips/{path.name}"] = path.read_bytes()
    return files
