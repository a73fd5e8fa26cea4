"""Clips as people store them: the video-captions layout in spec.data.format parquet (a `video` column of
{bytes, path} structs, datasets' Video feature) and webdataset (KEY.mp4 + KEY.txt members) gives the
loose clips in their order, under their names, decoded to the same samples, and trains wan to the same
weights; a row or member that is not a video is named by its file and row or member before training,
or skipped under spec.data.skipBad."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from kubetune_api.rules import SKIP_RULES
from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.layouts import LAYOUTS
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.video import probe
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.data.restore_data import write_parquet, write_webdataset
from kubetune_trainer.storage.members import MEMBERS
from kubetune_trainer.storage.stream import read_bytes
from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_on, trained_weights, write_manifest
from tests.trainer.test_hostile_input import no_traceback

LAYOUT = LAYOUTS["video-captions"]
WRITERS = {"parquet": write_parquet, "webdataset": write_webdataset}


def video_spec(root: Path, data_format: str, **data) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "model": {"family": "wan", "pretrained": "/models/none"},
        "data": {"layout": "video-captions", "uri": str(root), "format": data_format, "resolution": 32, "frames": 5,
                 **data},
        "training": {"maxSteps": 1, "seed": 7}, "checkpoints": {"uri": "/checkpoints"}}, context={SKIP_RULES: True})


def screened(spec: TrainingJobSpec) -> tuple[list, Screen]:
    """The samples as a run gets them: read, then every clip probed (run.Run.set_up)."""
    screen = Screen(spec.data.skip_bad, LAYOUT.check(spec))
    return screen.images(LAYOUT.read_samples(spec, screen)), screen


def name_of(path: Path, root: Path) -> str:
    member = MEMBERS.member(path)
    return member.name if member else path.relative_to(root).as_posix()


@pytest.fixture(scope="module")
def loose(tmp_path_factory) -> Path:
    return write_tiny_data("video-captions", tmp_path_factory.mktemp("loose"), count=5, size=32, seed=0)


@pytest.mark.parametrize("data_format", WRITERS)
def test_clips_stored_in_a_format_are_the_loose_clips_in_their_order_names_and_frames(data_format, loose, tmp_path):
    stored = WRITERS[data_format]("video-captions", loose, tmp_path / data_format, per_file=2)  # 2 + 2 + 1
    expected, _ = screened(video_spec(loose, "files"))
    samples, _ = screened(video_spec(stored, data_format))
    assert [name_of(s.path, stored) for s in samples] == [name_of(s.path, loose) for s in expected]
    assert [s.caption for s in samples] == [s.caption for s in expected]
    assert [read_bytes(s.path) for s in samples] == [s.path.read_bytes() for s in expected]
    assert not any(s.path.exists() for s in samples), "local containers are read in place"
    assert [probe(s.path) for s in samples] == [probe(s.path) for s in expected], "frame counts, rates, keyframes"
    spec = video_spec(stored, data_format)
    transform = ImageTransform(spec.size, True, False)
    datasets = [LAYOUT.dataset(found, transform, spec, True) for found in (samples, expected)]
    for key in [(0, 0), (1, 3), (2, 4)]:
        got, wanted = (data[key] for data in datasets)
        assert got["frame_start"] == wanted["frame_start"]
        assert torch.equal(got["pixel_values"], wanted["pixel_values"]), key


def spoil_parquet_row(root: Path, row: int) -> Path:
    file = sorted(root.glob("*.parquet"))[0]
    table = pq.read_table(file)
    clips = table.column("video").to_pylist()
    clips[row] = {"bytes": b"<html>not a video</html>" * 20, "path": clips[row]["path"]}
    pq.write_table(table.set_column(0, "video", pa.array(clips, table.schema.field("video").type)), file)
    return file


def spoil_shard_member(root: Path, number: int) -> tuple[Path, str]:
    """The NUMBER-th clip of the first shard replaced by text (written again, the other members kept)."""
    shard = sorted(root.glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]
    clip = [info.name for info, _ in members if info.name.endswith(".mp4")][number]
    with tarfile.open(shard, "w") as tar:
        for info, data in members:
            data = b"<html>not a video</html>" * 20 if info.name == clip else data
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return shard, clip


@pytest.mark.parametrize("data_format", WRITERS)
def test_a_row_or_member_that_is_not_a_video_is_named_by_its_file_and_place_or_skipped(data_format, loose, tmp_path):
    stored = WRITERS[data_format]("video-captions", loose, tmp_path / data_format, per_file=2)
    if data_format == "parquet":
        where = f"{spoil_parquet_row(stored, 1)} row 1"
    else:
        shard, clip = spoil_shard_member(stored, 1)
        where = f"{shard} member {clip}"
    with pytest.raises(ConfigError) as refused:
        screened(video_spec(stored, data_format))
    message = str(refused.value)
    assert message.startswith(f"{where}: cannot be read as a video") and "\n" not in message, message
    assert "spec.data.skipBad: true" in message
    samples, screen = screened(video_spec(stored, data_format, skipBad=True))
    assert len(samples) == 4 and len(screen.skipped) == 1 and screen.skipped[0].startswith(f"{where}: ")


def test_a_shard_without_clip_members_names_the_extensions_it_looked_for(loose, tmp_path):
    root = write_webdataset("captions", write_tiny_data("captions", tmp_path / "images", count=2, size=32),
                            tmp_path / "shards")
    with pytest.raises(ConfigError, match=r"sample 0000: has no clip member 0000.mp4/webm/mov \(members: png, txt\)"):
        screened(video_spec(root, "webdataset"))


def test_the_trainer_refuses_a_row_that_is_not_a_video_in_one_line_before_writing_anything(tiny_model, loose,
                                                                                            tmp_path):
    stored = write_parquet("video-captions", loose, tmp_path / "pq", per_file=2)
    file = spoil_parquet_row(stored, 0)
    manifest = family_job("wan", "video-captions", tiny_model("wan"), stored, tmp_path / "out",
                          data={"format": "parquet", "frames": 5})
    result = run_trainer_on(write_manifest(manifest, tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{file} row 0: cannot be read as a video" in result.stderr, result.stderr[-3000:]
    assert no_traceback(result.stderr)
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"


@pytest.mark.slow
def test_wan_trains_the_same_weights_on_clips_as_loose_files_parquet_and_webdataset(tiny_model, loose, tmp_path):
    from tests.trainer.test_distributed import max_difference

    roots = {"files": loose, "parquet": write_parquet("video-captions", loose, tmp_path / "pq", per_file=2),
             "webdataset": write_webdataset("video-captions", loose, tmp_path / "wd", per_file=2)}
    weights = {}
    for data_format, root in roots.items():
        manifest = family_job("wan", "video-captions", tiny_model("wan"), root, tmp_path / data_format,
                              data={"format": data_format, "frames": 5, "randomFlip": True, "centerCrop": False})
        run_trainer(manifest, tmp_path)
        weights[data_format] = trained_weights(run_dir(tmp_path / data_format) / "checkpoint-2")
    assert max_difference(weights["files"], weights["parquet"]) == 0
    assert max_difference(weights["files"], weights["webdataset"]) == 0
