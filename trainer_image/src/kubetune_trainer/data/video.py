"""Video clips through PyAV (FFmpeg's libraries): what a clip holds, and the frames a sample takes.

A clip is whatever FFmpeg demuxes and decodes (.mp4 with H.264 or H.265, .webm with VP8/VP9/AV1,
.mov): its suffix decides nothing, its content does. Probing a clip (`probe`) demuxes every packet
of its first video stream without decoding them (cheap: the frame count, and where its keyframes
are) and decodes the first frame (the codec works); the frames a sample trains on are decoded in the
loader's workers (`read_frames`), from the last keyframe before them: a sample late in a long clip
does not decode the whole clip before it.

Frame rates: with spec.data.fps a clip is resampled to it, sample time t taking the source frame
nearest t at the clip's average rate (a variable-rate clip is treated as constant-rate at its
average); upsampling repeats frames. Without fps a sample takes consecutive source frames.
"""
from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from kubetune_trainer.storage.stream import in_place, open_ranged, read_bytes, remote

# Frames are decoded on one thread per loader worker: the workers are the parallelism (one per core
# is what benchmarks/video_decode.py measures), and FFmpeg's own threads would contend with them.
DECODE_THREADS = 1


class ClipError(ValueError):
    """Why a file cannot be trained on as a clip (its message completes "<path> ...")."""


@dataclass(frozen=True)
class ClipInfo:
    frames: int        # video frames it holds
    rate: float        # its average frame rate (frames per second)
    width: int
    height: int
    # (frame number, presentation timestamp) of each keyframe after the first, where decoding may
    # start; empty where the packets carry no timestamps (then decoding starts at the clip's start).
    keyframes: tuple[tuple[int, int], ...] = ()
    # A clip probed from its header only (its packets, so its keyframes, unread): frame n is shown at
    # first_pts + n * frame_ticks (a constant-rate clip, checked on its sample table), so decoding a
    # sample seeks to the time of its first frame and the demuxer's index finds the keyframe. None:
    # no such timeline (keyframes above, or decoding from the start).
    first_pts: int | None = None
    frame_ticks: int | None = None

    def keyframe_before(self, number: int) -> tuple[int, int] | None:
        """The last keyframe at or before frame `number` (None: decode from the start)."""
        return next((key for key in reversed(self.keyframes) if key[0] <= number), None)

    def positions(self, fps: float | None) -> int:
        """How many frames the clip gives at `fps` (its own frames when None)."""
        if fps is None:
            return self.frames
        return math.floor((self.frames - 1) * fps / self.rate + 1e-9) + 1

    def source_index(self, position: int, fps: float | None) -> int:
        """The source frame sample position `position` (at `fps`) takes: the nearest in time."""
        if fps is None:
            return position
        return min(self.frames - 1, math.floor(position * self.rate / fps + 0.5))

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of its frames."""
        return self.width, self.height

    def describe(self, fps: float | None) -> str:
        held = f"{self.frames} frames at {self.rate:g} fps"
        return held if fps is None or fps == self.rate else f"{held}, {self.positions(fps)} at spec.data.fps {fps:g}"


_probed: dict[tuple[str, int, int], ClipInfo] = {}
_probed_lock = threading.Lock()


def _source(path: Path):
    """What av.open reads PATH from: its file name, or (a parquet row's or a shard member's clip,
    storage.members) its bytes in memory."""
    return str(path) if in_place(path) else io.BytesIO(read_bytes(path))


def _memo_key(path: Path) -> tuple[str, int, int]:
    """Which version of PATH a probe is of: a local file's size and mtime; a streamed object or a
    container's member does not change under a run."""
    if in_place(path):
        stat = path.stat()
        return str(path), stat.st_size, stat.st_mtime_ns
    return str(path), 0, 0


def remember(found: dict[Path, ClipInfo]) -> None:
    """Take probes made elsewhere (another process's share of the screen) as this process's own, so
    no clip is probed twice; a local file gone here is left out (probed here if ever read)."""
    for path, info in found.items():
        try:
            key = _memo_key(path)
        except OSError:
            continue
        with _probed_lock:
            _probed.setdefault(key, info)


def probe(path: Path, decoding: bool = False) -> ClipInfo:
    """What the clip holds; ClipError when it is not a usable video. Remembered per file version (a
    clip stored in a container: per path, containers do not change under a run): the screen probes
    every clip before the data set is built, which probes them again.

    A clip streamed from s3:// and not fetched yet is probed by ranged reads: an .mp4/.mov's frame
    count is in its header (the sample table), so only the header and the first frame are read;
    its keyframes are not listed, but a constant-rate clip's timeline is kept (ClipInfo.first_pts,
    frame_ticks), so its samples still seek to the keyframe before them. Other
    containers (.webm) keep no count in the header: their packets are read, the whole clip.

    `decoding`: the clip is about to be decoded whole anyway (a sample's, probed as training reaches
    it): a streamed one is fetched whole first (the one GET its decoding needs) and its header read
    from those bytes, rather than ranged reads and then the fetch."""
    local = in_place(path)
    memo = _memo_key(path)
    with _probed_lock:
        if memo in _probed:
            return _probed[memo]
    fetched = not local and remote(path) and not decoding
    source = str(path) if local else open_ranged(path) if fetched else io.BytesIO(read_bytes(path))
    if (memo[1] if local else source.seek(0, io.SEEK_END)) == 0:
        raise ClipError("is empty (0 bytes): a zero-length clip")
    if not local:
        source.seek(0)
    info = _probe(source, header_only=fetched or (decoding and not local))
    with _probed_lock:
        _probed[memo] = info
    return info


def _probe(source, header_only: bool = False) -> ClipInfo:
    try:
        with av.open(source) as container:
            if not container.streams:  # a container header and nothing in it (an encoder given no frames)
                raise ClipError("holds no stream at all: a zero-length clip")
            if not container.streams.video:
                kinds = ", ".join(sorted({stream.type for stream in container.streams}))
                raise ClipError(f"holds no video stream (only {kinds}): it is not a video (.mp4 H.264/H.265, "
                                ".webm, .mov)")
            stream = container.streams.video[0]
            ticks = None
            if header_only and "mp4" in container.format.name and stream.frames > 0:
                frames, keyframes = stream.frames, ()  # the sample table's count: no packet read
                ticks = _constant_ticks(stream, frames)
            else:
                packets = [(packet.pts, packet.is_keyframe) for packet in container.demux(stream) if packet.size]
                frames, keyframes = len(packets), _keyframes(packets)
                container.seek(0)
            if frames == 0:
                raise ClipError("holds no video frames: a zero-length clip")
            stream.codec_context.thread_count = DECODE_THREADS
            first = next(container.decode(stream), None)
            if first is None:
                raise ClipError("has no decodable frame: the clip is broken")
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            if rate <= 0:
                duration = float(stream.duration * stream.time_base) if stream.duration else 0.0
                rate = frames / duration if duration > 0 else 0.0
            if rate <= 0:
                raise ClipError("has no frame rate (neither its stream nor its duration gives one)")
            timeline = (first.pts, ticks) if ticks is not None and first.pts is not None else (None, None)
            return ClipInfo(frames, rate, first.width, first.height, keyframes, *timeline)
    except av.FFmpegError as err:
        raise ClipError(f"cannot be read as a video ({type(err).__name__}: {err})") from None


def _keyframes(packets: list[tuple[int | None, bool]]) -> tuple[tuple[int, int], ...]:
    """Each keyframe's frame number (its rank in presentation order: packets come in decoding order)
    and timestamp, the first left out (decoding starts there anyway)."""
    if any(pts is None for pts, _ in packets):
        return ()
    number = {pts: rank for rank, pts in enumerate(sorted(pts for pts, _ in packets))}
    return tuple(sorted((number[pts], pts) for pts, key in packets if key and number[pts] > 0))


def _constant_ticks(stream, frames: int) -> int | None:
    """The one duration of every frame in the stream's time base, read from the demuxer's index (an
    .mp4's sample table, in its header: no packet read); None when the index does not hold every
    frame or the durations differ (a variable-rate clip: its samples decode from its start)."""
    try:
        stamps = sorted(entry.timestamp for entry in stream.index_entries)
    except (AttributeError, av.FFmpegError):
        return None
    steps = {later - earlier for earlier, later in zip(stamps, stamps[1:])}
    return steps.pop() if len(stamps) == frames and len(steps) == 1 and min(steps, default=0) > 0 else None


@dataclass(frozen=True)
class ClipCheck:
    """The screen's check of one clip (data.screening.FileCheck): usable, and long enough for the
    `shortest` of spec.data.frames at `fps`. What it finds is the clip's ClipInfo, which the screen
    hands to every process (`share`): each probes its share of the clips, none probes them all."""

    shortest: int
    fps: float | None

    def __call__(self, path: Path) -> tuple[str | None, ClipInfo | None]:
        try:
            info = probe(path)
        except ClipError as err:
            return str(err), None
        except OSError as err:  # gone or unreadable since the reader listed it
            return f"cannot be read ({type(err).__name__}: {err})", None
        if info.positions(self.fps) < self.shortest:
            return (f"is {info.describe(self.fps)}: shorter than spec.data.frames {self.shortest}; use a longer clip, "
                    "fewer spec.data.frames or a lower spec.data.fps"), None
        return None, info

    @staticmethod
    def share(found: dict[Path, ClipInfo]) -> None:
        remember(found)


def read_frames(path: Path, indices: list[int], size: tuple[int, int], crop: tuple[int, int, int, int],
                flip: bool, info: ClipInfo | None = None) -> np.ndarray:
    """Source frames `indices` (ascending, repeats allowed) as uint8 [frames, height, width, 3]: each
    resized to `size` (width, height), cropped to `crop` (left, top, width, height), maybe mirrored.
    Decodes from the last keyframe before the first index (`info`'s; else from the clip's start) up
    to the last index; only the frames kept are converted."""
    wanted = set(indices)
    last = max(indices)
    left, top, width, height = crop
    keyframe = info.keyframe_before(min(indices)) if info is not None else None
    kept: dict[int, np.ndarray] = {}
    try:
        with av.open(_source(path)) as container:
            video = container.streams.video[0]
            video.codec_context.thread_count = DECODE_THREADS
            numbered = _numbered(container, video, keyframe) if keyframe is not None or info is None \
                else _numbered_from_time(container, video, info, min(indices))
            for number, frame in numbered:
                if number in wanted:
                    rgb = frame.reformat(width=size[0], height=size[1], format="rgb24",
                                         interpolation="BICUBIC").to_ndarray()
                    rgb = rgb[top:top + height, left:left + width]
                    kept[number] = rgb[:, ::-1] if flip else rgb
                if number >= last:
                    break
    except (av.FFmpegError, IndexError) as err:
        raise ClipError(f"cannot be decoded ({type(err).__name__}: {err})") from None
    if last not in kept:
        raise ClipError(f"decoded only {len(kept) and max(kept) + 1} frames where frame {last + 1} was needed "
                        "(its frame count was read before training): the clip is truncated or changed")
    return np.stack([kept[index] for index in indices])


def _numbered(container, stream, keyframe: tuple[int, int] | None):
    """(frame number, frame) in presentation order from `keyframe` (number, pts), or from the start.
    Frames shown before the keyframe that decoding from it still yields (an open GOP's) are passed
    over; if the seek lands elsewhere than on the keyframe, decoding starts again from the start."""
    if keyframe is not None:
        number, pts = keyframe
        container.seek(pts, stream=stream, backward=True)
        frames = (frame for frame in container.decode(stream) if frame.pts is not None and frame.pts >= pts)
        first = next(frames, None)
        if first is not None and first.pts == pts:
            yield number, first
            yield from enumerate(frames, start=number + 1)
            return
        container.seek(0, stream=stream, backward=True)
    yield from enumerate(container.decode(stream))


def _numbered_from_time(container, stream, info: ClipInfo, first: int):
    """(frame number, frame) in presentation order from the keyframe at or before frame `first`,
    found by seeking to that frame's time on the clip's constant-rate timeline (ClipInfo.first_pts,
    frame_ticks); frames are numbered by their timestamps. A seek that lands after `first` (a
    keyframe's decoding time is before its presentation time, and the index seeks by the former) is
    retried that many frames earlier; a frame off the timeline, or no landing, decodes from the start."""
    if info.first_pts is None or info.frame_ticks is None or first == 0:
        yield from _numbered(container, stream, None)
        return
    target = first
    for _ in range(3):
        container.seek(info.first_pts + target * info.frame_ticks, stream=stream, backward=True)
        frames = container.decode(stream)
        landed = next(frames, None)
        if landed is None or landed.pts is None:
            break
        number, off = divmod(landed.pts - info.first_pts, info.frame_ticks)
        if off or number < 0:
            break
        if number <= first:
            yield number, landed
            yield from enumerate(frames, start=number + 1)
            return
        target = max(0, target - (number - first) - 1)
    container.seek(0, stream=stream, backward=True)
    yield from enumerate(container.decode(stream))


def write_clip(path: Path, frames: list[np.ndarray], fps: int | Fraction, codec: str = "libx264", **options: str) -> Path:
    """Encode RGB uint8 frames [height, width, 3] into a clip (H.264 in .mp4 by default); for tiny data
    sets, tests and benchmarks. Sides must be even (4:2:0 chroma)."""
    height, width = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
