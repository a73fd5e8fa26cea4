"""The video-captions layout: video clips plus metadata.jsonl lines of {"file_name": ..., "text": ...},
or, without metadata.jsonl, each clip with its caption in NAME.txt beside it (data.caption_files).

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

What a clip holds (frame count, rate, size: data.video.probe) is read before the first step only
where the sampler needs it (`needs_clip_facts`: frame-count buckets, aspect-ratio buckets); else
each clip is probed when a sample first takes it, in the loader worker that decodes it. Local clips
are probed before training anyway, by the screen (shared between the processes); streamed ones are
then found bad only when training reaches them, as streamed images are.

Clips stored as parquet rows or WebDataset members (spec.data.format) are read from their containers
into memory (data.video), and named by their container and row or member.
"""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_api.spec_data import data_columns, frame_counts
from kubetune_trainer.data import captions, video
from kubetune_trainer.data.captions import read_captions
from kubetune_trainer.data.images import Crop, ImageTransform, cover_size, crop_origin
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.layout_parts import Layout
from kubetune_trainer.data.records import Stored
from kubetune_trainer.data.screening import CHECK_THREADS, FileCheck, Screen
from kubetune_trainer.data.tiny_drawing import COLOURS, SHAPES, draw_shape
from kubetune_trainer.data.video import ClipError, probe, read_frames
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.stream import VIDEO_SUFFIXES, describe

VIDEOS_FOLDER = "videos"


@dataclass(frozen=True)
class CaptionedClip:
    path: Path
    caption: str


def read_video_captions(root: Path, screen: Screen, file_column: str = "file_name",
                        caption_column: str = "text") -> list[CaptionedClip]:
    """The clips and captions of metadata.jsonl (or of NAME.txt files); a bad line goes to the screen
    (the clips themselves are checked by the screen's clip check, data.video.ClipCheck)."""
    return [CaptionedClip(sample.path, sample.caption) for sample in
            read_captions(root, screen, file_column, caption_column, VIDEOS_FOLDER, "video-captions",
                          VIDEO_SUFFIXES)]


def loose_samples(root: Path) -> list[tuple[Path, str, str, tuple[Path, ...]]]:
    """The data set as data.restore_data stores it again: (clip, its name, caption, no controls) each."""
    return [(s.path, s.path.relative_to(root).as_posix(), s.caption, ())
            for s in read_video_captions(root, Screen(skip_bad=False))]


def _probe_or_error(path: Path):
    try:
        return probe(path)
    except ClipError as err:
        return err


def needs_clip_facts(frames: list[int], bucketing: bool) -> bool:
    """Whether the sampler's groups depend on what each clip holds: its frame count picks one of
    several spec.data.frames, its size an aspect-ratio bucket. One count and no buckets: every clip
    batches with every other, and a clip is probed only when a sample takes it."""
    return bucketing or len(frames) > 1


def _failed(path: Path, err: ClipError) -> ConfigError:
    return ConfigError(f"{describe(path)}: {err}; fix or remove it (local clips are checked before training, "
                       "streamed ones as training reaches them unless spec.data.skipBad, spec.data.bucketing or "
                       "several spec.data.frames have them checked before; spec.data.skipBad applies there)")


class VideoCaptionsDataset(KeyedDataset):
    """Items {"pixel_values": [frames, 3, H, W] in [-1, 1], "caption", "full_caption", "crop",
    "frame_start"}: every frame of a sample gets the same crop and flip."""

    def __init__(self, samples: list[CaptionedClip], transform: ImageTransform, frames: list[int],
                 fps: float | None, caption_dropout: float, seed: int, bucketing: bool = False,
                 random_start: bool = True, start_per_sample: bool = False):
        self.fps = fps
        self.counts = frames
        if needs_clip_facts(frames, bucketing):
            # Remembered from the screen (every process's findings); a clip it did not see (a data set
            # built without it) is probed here, in parallel: a streamed clip's probe is a round trip or two.
            with ThreadPoolExecutor(CHECK_THREADS) as pool:
                found = list(pool.map(_probe_or_error, [sample.path for sample in samples]))
            for sample, info in zip(samples, found):
                if isinstance(info, ClipError):
                    raise _failed(sample.path, info)
            self.clips: list = found
            self.frames = [self._count(sample.path, info, frames) for sample, info in zip(samples, found)]
            sizes = [info.size for info in found]
        else:  # probed as samples take them (self.clip): the one count is every clip's
            self.clips, self.frames, sizes = [None] * len(samples), [frames[0]] * len(samples), None
        super().__init__(samples, [s.path for s in samples], transform, seed, bucketing, kinds=self.frames,
                         sizes=sizes)
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

    def clip(self, index: int):
        """What clip `index` holds: probed before training, or now (remembered per process); a clip
        that cannot give its sample is refused naming it."""
        info = self.clips[index]
        if info is None:
            path = self.samples[index].path
            try:
                info = probe(path, decoding=True)
            except ClipError as err:
                raise _failed(path, err) from None
            self._count(path, info, self.counts)
            self.clips[index] = info
        return info

    def start(self, key: tuple[int, int], rng: random.Random) -> int:
        """The sample's first position in its clip (at fps): drawn per epoch, or once per clip."""
        index = key[1]
        room = self.clip(index).positions(self.fps) - self.frames[index]
        if not self.random_start:
            return 0
        draw = random.Random(f"{self.seed}:start:{index}") if self.start_per_sample else rng
        return draw.randint(0, room)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        rng = self.rng(key)
        index = key[1]
        sample, info, count = self.samples[index], self.clip(index), self.frames[index]
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


# ---- the layout's parts (kubetune_api.data_layouts' row for it says what it is) ----

def read(spec: TrainingJobSpec, screen: Screen) -> list:
    image_column, caption_column, *_ = data_columns(spec.data)
    return read_video_captions(Path(spec.data.uri), screen, image_column, caption_column)


def dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec,
            training: bool) -> KeyedDataset:
    """A clip's start is drawn per epoch; once per clip with the embedding cache (its latents reused)."""
    data = spec.data
    return VideoCaptionsDataset(
        samples, transform, frame_counts(data.frames), data.fps, data.caption_dropout if training else 0.0,
        spec.training.seed, data.bucketing, random_start=training, start_per_sample=data.cache.enabled)


def check(spec: TrainingJobSpec) -> FileCheck:
    """Every clip: a video, not empty, and holding the shortest of spec.data.frames at spec.data.fps."""
    return video.ClipCheck(min(frame_counts(spec.data.frames)), spec.data.fps)


def screen_streamed(spec: TrainingJobSpec) -> bool:
    """Streamed clips are probed before the first step (from their headers, each process its share)
    only where that step needs them: to batch by their frame counts or aspect ratios, or to skip the
    bad ones (spec.data.skipBad: every process must leave out the same). Else each is probed as
    training reaches it, in the loader worker that decodes it, as streamed images are checked."""
    return spec.data.skip_bad or needs_clip_facts(frame_counts(spec.data.frames), spec.data.bucketing)


def from_stored(records: list[Stored], spec: TrainingJobSpec, screen: Screen) -> list:
    """Video-captions samples: captioned as images are; each clip is then probed by the layout's check."""
    return [CaptionedClip(sample.path, sample.caption) for sample in captions.from_stored(records, spec, screen)]


def write_tiny(out_dir: Path, count: int = 8, size: int = 64, seed: int = 0,
               frames: int | tuple[int, ...] = 9, fps: int = 16) -> Path:
    """H.264 .mp4 clips (PyAV) + metadata.jsonl of {file_name, text}: a shape sliding left or right.

    frames: per clip (a tuple: per clip in turn). The sides are rounded up to even (4:2:0 chroma)."""
    import numpy as np

    rng = random.Random(seed)
    side = size + size % 2
    counts = frames if isinstance(frames, tuple) else (frames,)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        colour, shape, direction = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(("left", "right"))
        still = np.asarray(draw_shape(colour, shape, side, rng))
        length = counts[i % len(counts)]
        step = max(1, side // (2 * length)) * (1 if direction == "right" else -1)
        name = f"{i:04d}.mp4"
        video.write_clip(out_dir / name, [np.roll(still, step * t, axis=1) for t in range(length)], fps)
        lines.append(json.dumps({"file_name": name, "text": f"a {colour} {shape} moving {direction}"}))
    (out_dir / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return out_dir


LAYOUT = Layout(read, dataset, collate, write_tiny, check=check, from_stored=from_stored,
                screen_streamed=screen_streamed, loose=loose_samples)
