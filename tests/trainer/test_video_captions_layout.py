"""The video-captions layout: real H.264 clips decoded by PyAV into [frames, 3, H, W] samples in
[-1, 1]; where a sample starts in its clip drawn from (seed, epoch, sample) only; spec.data.fps
resampling; frame-count and aspect-ratio buckets; every bad clip named before training (or skipped);
cache entries that differ with the frames a sample took."""
from __future__ import annotations

import json
import math
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from kubetune_api.rules import SKIP_RULES
from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.cache import EmbeddingCache, Encoder, LocalStore
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.layouts import LAYOUTS
from kubetune_trainer.data.sampler import epoch_steps
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.video import write_clip
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.data.tiny_data import write_tiny_data

LAYOUT = LAYOUTS["video-captions"]


def video_spec(data_dir: Path, **data) -> TrainingJobSpec:
    """A typed job on the layout, its rules left out: the data side alone, whatever a family takes."""
    return TrainingJobSpec.model_validate({
        "model": {"family": "sd15", "pretrained": "/models/none"},
        "data": {"layout": "video-captions", "uri": str(data_dir), "resolution": 32, "frames": 5, **data},
        "training": {"maxSteps": 1, "seed": 7}, "checkpoints": {"uri": "/checkpoints"}}, context={SKIP_RULES: True})


def screened(spec: TrainingJobSpec) -> tuple[list, Screen]:
    """The samples as a run gets them: read, then every clip checked (run.Run.set_up)."""
    screen = Screen(spec.data.skip_bad, LAYOUT.check(spec))
    return screen.images(LAYOUT.read(spec, screen)), screen


def dataset(spec: TrainingJobSpec, training: bool = True):
    samples, _ = screened(spec)
    size = spec.size
    return LAYOUT.dataset(samples, ImageTransform(size, spec.data.center_crop, spec.data.random_flip and training,
                                                  crop_per_sample=spec.data.cache.enabled), spec, training)


def grey_clip(path: Path, count: int, fps: int = 16, size: tuple[int, int] = (32, 32)) -> Path:
    """Frame i is uniformly grey at level 10 + 20 i: a decoded frame says which source frame it is."""
    width, height = size
    return write_clip(path, [np.full((height, width, 3), 10 + 20 * i, np.uint8) for i in range(count)], fps)


def source_frames(pixels: torch.Tensor) -> list[int]:
    """Which grey_clip frame each [3, H, W] frame of a sample is."""
    levels = ((pixels.mean(dim=(1, 2, 3)) + 1) * 127.5).tolist()
    return [round((level - 10) / 20) for level in levels]


def captioned(root: Path, clips: dict[str, str]) -> Path:
    (root / "metadata.jsonl").write_text("".join(json.dumps({"file_name": n, "text": t}) + "\n"
                                                 for n, t in clips.items()))
    return root


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    return write_tiny_data("video-captions", tmp_path_factory.mktemp("clips"), count=4, size=32, seed=0)


def test_the_tiny_writer_makes_real_h264_mp4_clips_with_their_captions(clips):
    lines = [json.loads(line) for line in (clips / "metadata.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(line["text"].startswith("a ") and " moving " in line["text"] for line in lines)
    with av.open(str(clips / lines[0]["file_name"])) as container:
        stream = container.streams.video[0]
        assert (container.format.name.split(",")[0], stream.codec_context.name) == ("mov", "h264")
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
    assert not np.array_equal(frames[0], frames[-1]), "the shape moves"


def test_a_sample_is_frames_consecutive_decoded_frames_scaled_to_minus_one_one(clips):
    data = dataset(video_spec(clips))
    item = data[(0, 0)]
    pixels = item["pixel_values"]
    assert pixels.shape == (5, 3, 32, 32) and pixels.dtype == torch.float32
    assert -1.0 <= pixels.min() < pixels.max() <= 1.0
    with av.open(str(data.samples[0].path)) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    start = item["frame_start"]
    expected = torch.from_numpy(np.stack(decoded[start:start + 5])).permute(0, 3, 1, 2).float() / 127.5 - 1
    assert torch.allclose(pixels, expected), "the sample is the clip's frames from its start, as decoded"
    batch = LAYOUT.collate([data[(0, 0)], data[(0, 1)]])
    assert batch["pixel_values"].shape == (2, 5, 3, 32, 32)
    assert batch["captions"] == [s.caption for s in data.samples[:2]] and len(batch["frame_starts"]) == 2


def test_the_start_is_drawn_per_epoch_from_the_seed_the_sample_and_the_epoch_only(clips):
    data, again = dataset(video_spec(clips)), dataset(video_spec(clips))  # as a second process builds it
    starts = [data[(epoch, 1)]["frame_start"] for epoch in range(12)]
    assert starts == [again[(epoch, 1)]["frame_start"] for epoch in range(12)]
    assert len(set(starts)) > 1 and all(0 <= start <= 4 for start in starts), starts  # 9 frames, 5 a sample
    reseeded = dataset(video_spec(clips).model_copy(update={"training": video_spec(clips).training.model_copy(
        update={"seed": 8})}))
    assert [reseeded[(epoch, 1)]["frame_start"] for epoch in range(12)] != starts
    cached = dataset(video_spec(clips, cache={"enabled": True}))
    assert len({cached[(epoch, 1)]["frame_start"] for epoch in range(12)}) == 1, "once per clip with the cache"
    held_out = dataset(video_spec(clips), training=False)
    assert {held_out[(epoch, 1)]["frame_start"] for epoch in range(3)} == {0}


def test_samples_decode_alike_in_the_loaders_worker_processes(clips):
    data = dataset(video_spec(clips))
    keys = [[(3, 0), (3, 1)], [(3, 2), (3, 3)]]
    loader = torch.utils.data.DataLoader(data, batch_sampler=keys, collate_fn=LAYOUT.collate, num_workers=2)
    for batch, step in zip(loader, keys):
        assert torch.equal(batch["pixel_values"], LAYOUT.collate([data[key] for key in step])["pixel_values"])


@pytest.mark.parametrize("fps, source", [
    (8, lambda t: 2 * t),                        # half the clip's 16 fps: every other frame
    (32, lambda t: math.floor(t / 2 + 0.5)),     # double: each frame twice, the nearest in time
    (None, lambda t: t),                         # the clip's own frames
])
def test_fps_resamples_each_clip_to_the_nearest_source_frames(tmp_path, fps, source):
    grey_clip(tmp_path / "count.mp4", 12)
    spec = video_spec(captioned(tmp_path, {"count.mp4": "grey"}), frames=4, **({"fps": fps} if fps else {}))
    data = dataset(spec)
    starts = set()
    for epoch in range(8):
        item = data[(epoch, 0)]
        start = item["frame_start"]  # a position at fps
        starts.add(start)
        assert source_frames(item["pixel_values"]) == [source(start + t) for t in range(4)], start
    assert len(starts) > 1
    assert data.clips[0].positions(fps) == {8: 6, 32: 23, None: 12}[fps]  # the last sample ends in the clip


def test_clips_bucket_by_frame_count_and_aspect_ratio_and_a_step_keeps_to_one(tmp_path):
    shapes = {"short-wide.mp4": (5, (64, 32)), "short-wide2.mp4": (6, (64, 32)), "long-wide.mp4": (9, (64, 32)),
              "long-wide2.mp4": (10, (64, 32)), "long-tall.mp4": (9, (32, 64)), "long-tall2.mp4": (9, (32, 64))}
    for name, (count, size) in shapes.items():
        grey_clip(tmp_path / name, count, size=size)
    spec = video_spec(captioned(tmp_path, {name: name for name in shapes}), frames=[5, 9], bucketing=True)
    data = dataset(spec)
    names = [s.path.name for s in data.samples]
    assert [data.frames[names.index(n)] for n in shapes] == [5, 5, 9, 9, 9, 9], "the longest count each holds"
    groups = {name: data.groups[names.index(name)] for name in shapes}
    assert groups["short-wide.mp4"] == groups["short-wide2.mp4"] != groups["long-wide.mp4"] == groups["long-wide2.mp4"]
    assert groups["long-tall.mp4"] == groups["long-tall2.mp4"]
    assert groups["long-tall.mp4"] not in (groups["long-wide.mp4"], groups["short-wide.mp4"])
    for step in epoch_steps(len(data), 2, seed=0, epoch=0, groups=data.groups):
        batch = LAYOUT.collate([data[key] for key in step])  # stacks: one count, one bucket
        width, height = data.bucket_sizes[data.buckets[step[0][1]]]
        assert batch["pixel_values"].shape == (2, data.frames[step[0][1]], 3, height, width)
        assert width > height if "wide" in names[step[0][1]] else width < height


def counting_probes(monkeypatch) -> list:
    """Every clip probed from now on in this process (its memory of earlier probes forgotten)."""
    from kubetune_trainer.data import video

    probed, real = [], video._probe
    monkeypatch.setattr(video, "_probed", {})
    monkeypatch.setattr(video, "_probe", lambda source, header_only=False: probed.append(source) or
                        real(source, header_only))
    return probed


def test_with_one_frame_count_and_no_buckets_a_clip_is_probed_only_when_a_sample_takes_it(clips, tmp_path,
                                                                                          monkeypatch):
    """What a streamed data set gets before its first step (run.Run.set_up screens it only where the
    sampler needs the clips' facts): no clip probed to build it, the same starts as clips probed before,
    and a bad clip named when a sample reaches it."""
    probed = counting_probes(monkeypatch)
    spec = video_spec(clips)
    assert not LAYOUT.screen_streamed(spec)
    lazy = LAYOUT.dataset(LAYOUT.read(spec, Screen(False)), ImageTransform(32), spec, True)
    assert probed == [] and lazy.groups is None
    probed_before = dataset(video_spec(clips, bucketing=True))  # square clips: one bucket, the same crops
    assert len(probed) == 4
    for epoch in range(6):
        assert torch.equal(lazy[(epoch, 1)]["pixel_values"], probed_before[(epoch, 1)]["pixel_values"])
        assert lazy[(epoch, 1)]["frame_start"] == probed_before[(epoch, 1)]["frame_start"]
    for needs in ({"bucketing": True}, {"frames": [5, 9]}, {"skipBad": True}):
        assert LAYOUT.screen_streamed(video_spec(clips, **needs)), needs

    grey_clip(tmp_path / "good.mp4", 9)
    (tmp_path / "bad.mp4").write_text("a caption, not a clip\n" * 40)
    spec = video_spec(captioned(tmp_path, {"good.mp4": "g", "bad.mp4": "b"}))
    data = LAYOUT.dataset(LAYOUT.read(spec, Screen(False)), ImageTransform(32), spec, True)
    assert data[(0, 0)]["pixel_values"].shape == (5, 3, 32, 32)
    with pytest.raises(ConfigError) as refused:
        data[(0, 1)]
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'bad.mp4'}: cannot be read as a video") and "\n" not in message
    assert "fix or remove it" in message and "as training reaches them" in message, message


def test_each_process_probes_its_share_of_the_clips_and_takes_the_others_findings(clips, monkeypatch):
    spec = video_spec(clips, bucketing=True)  # the sampler needs every clip's facts before the first step
    samples = LAYOUT.read(spec, Screen(False))
    theirs = []  # what the second of two processes found, then forgotten: its memory is not this one's
    Screen(False, LAYOUT.check(spec)).images(samples, rank=1, world_size=2,
                                             gather=lambda mine: theirs.append(mine) or [mine])
    probed = counting_probes(monkeypatch)
    kept = Screen(False, LAYOUT.check(spec)).images(samples, rank=0, world_size=2,
                                                    gather=lambda mine: [mine, theirs[0]])
    assert len(probed) == 2, "this process probed its two clips of four"
    data = LAYOUT.dataset(kept, ImageTransform(32), spec, True)
    assert len(probed) == 2 and len(data.groups) == 4 and None not in data.clips, "and none of the other's"


def header_only(path: Path) -> None:
    """An .mp4 whose encoder was given no frames: a container header, no stream."""
    container = av.open(str(path), "w")
    stream = container.add_stream("libx264", rate=16)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    container.start_encoding()
    container.close()


def audio_only(path: Path) -> None:
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        for number in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, number * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_too_few_clips_of_any_one_frame_count_for_a_step_is_named_with_the_frame_counts(tmp_path):
    from kubetune_trainer.data.sampler import check_enough_samples

    grey_clip(tmp_path / "short.mp4", 5)
    grey_clip(tmp_path / "long.mp4", 9)
    data = dataset(video_spec(captioned(tmp_path, {"short.mp4": "s", "long.mp4": "l"}), frames=[5, 9]))
    assert sorted(data.frames) == [5, 9]
    with pytest.raises(ConfigError, match=r"fewer than one optimizer step \(2 = .*\) in any group batched together "
                                          r"\(.* one count of spec.data.frames"):
        check_enough_samples(len(data), 2, data.groups)


BAD_CLIPS = {
    "not a video": (lambda p: p.write_text("a caption, not a clip\n" * 40), "cannot be read as a video"),
    "sound only": (audio_only, "holds no video stream (only audio): it is not a video"),
    "a zero-length clip": (lambda p: p.write_bytes(b""), "is empty (0 bytes): a zero-length clip"),
    "a clip of no frames": (header_only, "holds no stream at all: a zero-length clip"),
    "a clip shorter than frames": (lambda p: grey_clip(p, 3), "is 3 frames at 16 fps: shorter than spec.data.frames 5"),
}


@pytest.fixture
def spoiled(tmp_path) -> Path:
    """Two good clips and each kind of bad one."""
    grey_clip(tmp_path / "good0.mp4", 9)
    grey_clip(tmp_path / "good1.mp4", 9)
    names = {}
    for number, (what, (spoil, _)) in enumerate(BAD_CLIPS.items()):
        names[f"bad{number}.mp4"] = what
        spoil(tmp_path / f"bad{number}.mp4")
    return captioned(tmp_path, {"good0.mp4": "good", "good1.mp4": "good", **names})


@pytest.mark.parametrize("what", BAD_CLIPS)
def test_a_bad_clip_is_refused_before_training_in_one_line_naming_the_file_and_the_fix(tmp_path, what):
    spoil, words = BAD_CLIPS[what]
    grey_clip(tmp_path / "good.mp4", 9)
    spoil(tmp_path / "bad.mp4")
    spec = video_spec(captioned(tmp_path, {"good.mp4": "good", "bad.mp4": what}))
    with pytest.raises(ConfigError) as refused:
        screened(spec)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'bad.mp4'}: {words}") and "\n" not in message, message
    assert "spec.data.skipBad: true" in message


def test_a_clip_long_enough_at_its_own_rate_but_not_at_fps_is_named_with_both(tmp_path):
    grey_clip(tmp_path / "slow.mp4", 9)
    spec = video_spec(captioned(tmp_path, {"slow.mp4": "slow"}), fps=4)
    with pytest.raises(ConfigError, match=r"slow.mp4: is 9 frames at 16 fps, 3 at spec.data.fps 4: shorter than "
                                          r"spec.data.frames 5; use a longer clip, fewer spec.data.frames or a lower "
                                          r"spec.data.fps; fix or remove it"):
        screened(spec)


def test_with_skip_bad_every_bad_clip_is_left_out_and_named(spoiled):
    samples, screen = screened(video_spec(spoiled, skipBad=True))
    assert [s.path.name for s in samples] == ["good0.mp4", "good1.mp4"]
    assert len(screen.skipped) == len(BAD_CLIPS)
    for number, (_, words) in enumerate(BAD_CLIPS.values()):
        assert any(problem.startswith(f"{spoiled / f'bad{number}.mp4'}: {words}") for problem in screen.skipped)


def test_a_family_screens_clips_through_its_layout_before_building_the_data_sets(spoiled):
    """What run.Run.set_up does with any family: read, screen with the layout's check, build."""
    from kubetune_trainer.families.base import ModelFamily

    class Reader(ModelFamily):
        def compute_loss(self, model, batch, random):
            raise AssertionError("not trained here")

    family = Reader(video_spec(spoiled, skipBad=True), torch.device("cpu"), torch.float32)
    samples = family.screen.images(family.read_samples())
    training, _ = family.build_datasets(samples)
    assert len(training) == 2 and training[(0, 0)]["pixel_values"].shape == (5, 3, 32, 32)
    assert len(family.screen.skipped) == len(BAD_CLIPS)


def test_a_cache_entry_is_the_frames_a_sample_took(clips, tmp_path):
    """The cache keys an entry by what the encoder reads (data.cache): the clip's frames from the
    drawn start, at fps, cropped and resized; another start is another entry, the same one a hit."""
    calls = []
    encoder = Encoder("latents", "a test encoder", lambda batch: calls.append(len(batch)) or
                      {"latents": torch.stack([pixels.mean(dim=(1, 2, 3)) for pixels in batch])})
    cache = EmbeddingCache(LocalStore(tmp_path / "cache"))
    data = dataset(video_spec(clips))
    by_start = {}
    for epoch in range(12):
        by_start.setdefault(data[(epoch, 1)]["frame_start"], epoch)
    assert len(by_start) > 1
    for epoch in by_start.values():
        cache.encode(encoder, [data[(epoch, 1)]["pixel_values"]])
    assert cache.misses == len(by_start) and cache.hits == 0
    for epoch in range(12):
        cache.encode(encoder, [data[(epoch, 1)]["pixel_values"]])
    assert cache.misses == len(by_start) and cache.hits == 12, "every later epoch finds its start's entry"


def test_kubetune_dev_tiny_data_writes_clips(tmp_path):
    from click.testing import CliRunner

    from kubetune_cli.main import cli

    result = CliRunner().invoke(cli, ["dev", "tiny-data", "--layout", "video-captions", "--out", str(tmp_path),
                                      "--count", "2", "--size", "16"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000.mp4", "0001.mp4", "metadata.jsonl"]


@pytest.mark.parametrize("suffix, codec", [(".mp4", "libx264"), (".mp4", "libx265"), (".mov", "libx264"),
                                           (".webm", "libvpx-vp9")])
def test_a_sample_late_in_a_clip_decodes_from_the_keyframe_before_it_with_the_same_frames(tmp_path, suffix, codec):
    from kubetune_trainer.data.video import _numbered, probe, read_frames

    path = write_clip(tmp_path / f"long{suffix}", [np.full((32, 32, 3), 5 * i, np.uint8) for i in range(48)], 16,
                      codec, g="8", **({"bf": "2"} if codec != "libvpx-vp9" else {}))
    info = probe(path)
    assert info.frames == 48 and info.keyframe_before(29) is not None and info.keyframe_before(29)[0] > 8
    with av.open(str(path)) as container:  # decoding starts at the keyframe, not at the clip's start
        assert next(_numbered(container, container.streams.video[0], info.keyframe_before(29)))[0] \
            == info.keyframe_before(29)[0]
    for indices in ([29, 30, 31, 32], [40, 40, 47], [0, 1, 2]):
        frames = read_frames(path, indices, (32, 32), (0, 0, 32, 32), False, info)
        assert [round(level / 5) for level in frames.mean(axis=(1, 2, 3))] == indices
        assert np.array_equal(frames, read_frames(path, indices, (32, 32), (0, 0, 32, 32), False)), "as from the start"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_clip_cut_short_after_it_was_probed_stops_the_loader_in_one_line_naming_it(tmp_path, workers):
    """Probed whole before training, then truncated under the run: decoding it names the clip in one line,
    in the training process or from a loader worker alike (no worker traceback in the message)."""
    from kubetune_trainer.loop import iterate_steps

    for name in ("a.mp4", "b.mp4"):
        grey_clip(tmp_path / name, 9)
    data = dataset(video_spec(captioned(tmp_path, {"a.mp4": "a", "b.mp4": "b"}), frames=9), training=False)
    clip = tmp_path / "b.mp4"
    clip.write_bytes(clip.read_bytes()[:len(clip.read_bytes()) // 3])
    with pytest.raises(ConfigError) as stopped:
        list(iterate_steps(data, LAYOUT.collate, workers, [[[(0, 0)]], [[(0, 1)]]], loader_seed=0))
    message = str(stopped.value)
    assert message.startswith(f"{clip}: ") and "fix or remove it" in message and "\n" not in message, message


@pytest.mark.parametrize("suffix, codec", [(".mp4", "libx264"), (".mp4", "libx265"), (".mov", "libx264")])
def test_a_streamed_clip_probed_from_its_header_seeks_to_the_keyframe_before_a_late_sample(tmp_path, suffix, codec):
    """A clip probed through ranged reads (s3://, its header only: no keyframe list) keeps its frame
    timeline, and a late sample seeks by time to the keyframe before it: the same frames, bit for bit,
    as decoding from the clip's start."""
    from kubetune_trainer.data.video import _numbered_from_time, _probe, read_frames
    from kubetune_trainer.storage.stream import ranged_file

    path = write_clip(tmp_path / f"long{suffix}", [np.full((32, 32, 3), 5 * i, np.uint8) for i in range(48)], 16,
                      codec, g="8", bf="2")
    data = path.read_bytes()
    info = _probe(ranged_file(lambda start, size: data[start:start + size], len(data)), header_only=True)
    assert info.frames == 48 and info.keyframes == () and info.frame_ticks, info
    with av.open(str(path)) as container:  # decoding starts at a keyframe after the clip's start
        landed = next(_numbered_from_time(container, container.streams.video[0], info, 29))[0]
    assert 8 <= landed <= 29, landed
    for indices in ([29, 30, 31, 32], [40, 40, 47], [0, 1, 2], [8, 9], [7, 8]):
        frames = read_frames(path, indices, (32, 32), (0, 0, 32, 32), False, info)
        assert [round(level / 5) for level in frames.mean(axis=(1, 2, 3))] == indices
        assert np.array_equal(frames, read_frames(path, indices, (32, 32), (0, 0, 32, 32), False)), "as from the start"
