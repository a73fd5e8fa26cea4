"""The video-captions layout: video clips plus metadata.jsonl lines of {"file_name": ..., "text": ...}.

Read as the captions layout is (data.captions: the same keys, spec.data.imageColumn and
captionColumn; a clip beside metadata.jsonl or in a videos/ folder beside it), decoded with PyAV
in the loader's workers (data.video).

A sample is `frames` consecutive frames of its clip at spec.data.fps: spec.data.frames, or with a
list of counts (frame-count buckets) the longest the clip holds; the sampler batches clips of one
count (and, with spec.data.bucketing, of one aspect-ratio bucket). Where it starts in the clip is
drawn from (seed, epoch, sample) like every augmentation (data.keyed), so it changes each epoch and
never depends on the number of processes; with the embedding cache on it is drawn once per clip,
from (seed, sample), so its latents are reused every epoch (as a random crop is). Held-out clips
start at their first frame.

Clips stored as parquet rows or WebDataset members (spec.data.format) are read from their containers
into memory (data.video), and named by their container and row or member.
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_trainer.data import captions
from kubetune_trainer.data.captions import read_captions
from kubetune_trainer.data.images import Crop, ImageTransform, cover_size, crop_origin
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.screening import CHECK_THREADS, Screen
from kubetune_trainer.data.video import ClipError, probe, read_frames
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.stream import describe

VIDEOS_FOLDER = "videos"


@dataclass(frozen=True)
class CaptionedClip:
    path: Path
    caption: str


def read_video_captions(root: Path, screen: Screen, file_column: str = "file_name",
                        caption_column: str = "text") -> list[CaptionedClip]:
    """metadata.jsonl's clips and captions; a bad line goes to the screen (the clips themselves are
    checked by the screen's clip check, data.video.clip_check)."""
    return [CaptionedClip(sample.path, sample.caption) for sample in
            read_captions(root, screen, file_column, caption_column, VIDEOS_FOLDER, "video-captions")]


def _probe_or_error(path: Path):
    try:
        return probe(path)
    except ClipError as err:
        return err


def _failed(path: Path, err: ClipError) -> ConfigError:
    return ConfigError(f"{describe(path)}: {err}; fix or remove it (every clip is checked before training, and "
                       "spec.data.skipBad applies there)")


class VideoCaptionsDataset(KeyedDataset):
    """Items {"pixel_values": [frames, 3, H, W] in [-1, 1], "caption", "full_caption", "crop",
    "frame_start"}: every frame of a sample gets the same crop and flip."""

    def __init__(self, samples: list[CaptionedClip], transform: ImageTransform, frames: list[int],
                 fps: float | None, caption_dropout: float, seed: int, bucketing: bool = False,
                 random_start: bool = True, start_per_sample: bool = False):
        # Remembered from the screen for this process's share; the others' clips are probed again, in
        # parallel: a streamed clip's probe is a ranged GET or two, a round trip each.
        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            found = list(pool.map(_probe_or_error, [sample.path for sample in samples]))
        for sample, info in zip(samples, found):
            if isinstance(info, ClipError):
                raise _failed(sample.path, info)
        self.clips = found
        self.fps = fps
        self.frames = [self._count(sample.path, info, frames) for sample, info in zip(samples, self.clips)]
        super().__init__(samples, [s.path for s in samples], transform, seed, bucketing, kinds=self.frames,
                         sizes=[(info.width, info.height) for info in self.clips])
        self.caption_dropout = caption_dropout
        self.random_start = random_start
        self.start_per_sample = start_per_sample

    def _count(self, path: Path, info, counts: list[int]) -> int:
        """The longest of spec.data.frames the clip holds at fps."""
        held = [count for count in counts if count <= info.positions(self.fps)]
        if not held:
            raise ConfigError(f"{describe(path)}: is {info.describe(self.fps)}: shorter than spec.data.frames {min(counts)}; "
                              "use a longer clip, fewer spec.data.frames or a lower spec.data.fps")
        return max(held)

    def start(self, key: tuple[int, int], rng: random.Random) -> int:
        """The sample's first position in its clip (at fps): drawn per epoch, or once per clip."""
        index = key[1]
        room = self.clips[index].positions(self.fps) - self.frames[index]
        if not self.random_start:
            return 0
        draw = random.Random(f"{self.seed}:start:{index}") if self.start_per_sample else rng
        return draw.randint(0, room)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        rng = self.rng(key)
        index = key[1]
        sample, info, count = self.samples[index], self.clips[index], self.frames[index]
        start = self.start(key, rng)
        flip = self.transform.random_flip and rng.random() < 0.5
        width, height = self.bucket_sizes[self.buckets[index]] if self.buckets is not None \
            else self.transform.width_height
        covered = cover_size((info.width, info.height), width, height)
        crop_rng = random.Random(f"{self.seed}:crop:{index}") if self.transform.crop_per_sample else rng
        left, top = crop_origin(covered, (width, height), self.transform.center_crop, crop_rng)
        indices = [info.source_index(start + offset, self.fps) for offset in range(count)]
        try:
            frames = read_frames(sample.path, indices, covered, (left, top, width, height), flip, info)
        except ClipError as err:
            raise _failed(sample.path, err) from None
        # Reordered while still uint8, then one float pass and one in place: at 81x480p a sample is
        # 388 MB of float32, and each pass over it costs a worker about 0.15 s.
        pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous().to(torch.float32)
        pixels = pixels.div_(127.5).sub_(1.0)  # as images.to_tensor: the same values bit for bit
        caption = "" if rng.random() < self.caption_dropout else sample.caption
        return {"pixel_values": pixels, "caption": caption, "full_caption": sample.caption,
                "crop": Crop((info.height, info.width), (top, left)), "frame_start": start}


def collate(items: list[dict]) -> dict:
    """The captions layout's batch, its pixel_values [B, frames, 3, H, W] (a batch's clips have as many
    frames: the sampler's groups), and each sample's first position in its clip, at fps."""
    return {**captions.collate(items), "frame_starts": [item["frame_start"] for item in items]}
