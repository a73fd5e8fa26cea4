"""spec.data.format parquet and webdataset: the same samples as the loose files, in the same order and
under the same names; the forms people's parquet files take; bad files refused in one line naming
the file and its row or member (or skipped under spec.data.skipBad), before anything is written."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from kubetune_api.spec_data import DATA_FORMATS, DataSpec
from kubetune_api.data_layouts import stored_as
from kubetune_trainer.data.layouts import LAYOUTS
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.data.restore_data import loose_samples, write_parquet, write_webdataset
from kubetune_trainer.storage.members import MEMBERS
from kubetune_trainer.storage.stream import image_size, read_bytes
from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.trainer.conftest import family_job, run_trainer_on, tiny_sd15, write_manifest  # noqa: F401
from tests.trainer.test_hostile_input import no_traceback

FAMILY_OF = {"captions": "sd15", "image-folder": "classifier", "edit-pairs": "qwen-image-edit-plus"}
WRITERS = {"parquet": write_parquet, "webdataset": write_webdataset}


def spec_for(layout: str, root: Path, data_format: str, **data):
    from kubetune_api.spec import TrainingJobSpec

    return TrainingJobSpec.model_validate({
        "model": {"family": FAMILY_OF[layout], "pretrained": "/models/tiny"},
        "data": {"layout": layout, "uri": str(root), "format": data_format, **data},
        "training": {"maxSteps": 2}, "checkpoints": {"uri": "/runs"}})


def read(layout: str, root: Path, data_format: str, skip_bad: bool = False, **data) -> tuple[list, Screen]:
    screen = Screen(skip_bad)
    return LAYOUTS[layout].read_samples(spec_for(layout, root, data_format, **data), screen), screen


def stored_name(path: Path, root: Path) -> str:
    member = MEMBERS.member(path)
    return member.name if member else path.relative_to(root).as_posix()


CASES = [("captions", "parquet", {}), ("captions", "webdataset", {}), ("image-folder", "parquet", {}),
         ("image-folder", "webdataset", {}), ("edit-pairs", "parquet", {}),
         # Several control images: a list column (Sequence(Image())), and KEY.control_0.png, ... members.
         ("edit-pairs", "parquet", {"references": (1, 3)}), ("edit-pairs", "webdataset", {"references": (1, 3)})]


@pytest.mark.parametrize("layout,data_format,options", CASES,
                         ids=[f"{l}-{f}" + ("-several" if o else "") for l, f, o in CASES])
def test_each_format_holds_the_samples_of_the_loose_files_in_their_order_and_names(layout, data_format, options,
                                                                                   tmp_path):
    loose = write_tiny_data(layout, tmp_path / "loose", count=8, size=32, seed=0, **options)
    stored = WRITERS[data_format](layout, loose, tmp_path / data_format, per_file=3)  # 3 files: 3 + 3 + 2
    expected, _ = read(layout, loose, "files")
    samples, _ = read(layout, stored, data_format)
    image = {"edit-pairs": "target"}.get(layout, "path")
    text = {"captions": "caption", "image-folder": "label", "edit-pairs": "instruction"}[layout]
    assert [stored_name(getattr(s, image), stored) for s in samples] == \
        [stored_name(getattr(s, image), loose) for s in expected]
    assert [read_bytes(getattr(s, image)) for s in samples] == [getattr(s, image).read_bytes() for s in expected]
    assert [image_size(getattr(s, image)) for s in samples] == [image_size(getattr(s, image)) for s in expected], \
        "aspect-ratio buckets see the sizes loose files have"
    assert [getattr(s, text) for s in samples] == [getattr(s, text) for s in expected]
    if layout == "edit-pairs":
        assert [[read_bytes(c) for c in s.controls] for s in samples] == \
            [[c.read_bytes() for c in s.controls] for s in expected], "the control images, in order"
    assert not any(getattr(s, image).exists() for s in samples), "local containers are read in place"
    if layout == "image-folder":  # the classifier's head is sized and named by the classes
        from kubetune_trainer.data.image_folder import read_labelled

        assert read_labelled(spec_for(layout, stored, data_format), Screen(False))[1] == ["circle", "square"]
    if layout == "image-folder":  # the classifier's head is sized and named by the classes
        from kubetune_trainer.data.image_folder import read_labelled

        assert read_labelled(spec_for(layout, stored, data_format), Screen(False))[1] == ["circle", "square"]


def one_file(path: Path, **columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path.parent


def test_parquet_images_as_plain_bytes_or_as_paths_relative_to_the_data_read_as_structs_do(tmp_path):
    loose = write_tiny_data("captions", tmp_path / "loose", count=3, size=32, seed=0)
    samples = loose_samples("captions", loose)
    as_bytes = one_file(tmp_path / "bytes" / "data.parquet", picture=[p.read_bytes() for p, _, _, _ in samples],
                        prompt=[c for _, _, c, _ in samples])
    read_back, _ = read("captions", as_bytes, "parquet", imageColumn="picture", captionColumn="prompt")
    assert [(read_bytes(s.path), s.caption) for s in read_back] == [(p.read_bytes(), c) for p, _, c, _ in samples]
    as_paths = one_file(loose / "index.parquet", image=[name for _, name, _, _ in samples],
                        text=[c for _, _, c, _ in samples])
    read_back, _ = read("captions", as_paths, "parquet")
    assert [(s.path, s.caption) for s in read_back] == [(p, c) for p, _, c, _ in samples], "paths are the loose files"


def test_a_control_column_of_lists_of_bytes_or_of_paths_reads_as_lists_of_structs_do(tmp_path):
    loose = write_tiny_data("edit-pairs", tmp_path / "loose", count=3, size=32, seed=0, references=(2, 1))
    samples = loose_samples("edit-pairs", loose)
    expected = [[c.read_bytes() for c in controls] for *_, controls in samples]
    targets = [{"bytes": p.read_bytes(), "path": name} for p, name, _, _ in samples]
    texts = [text for _, _, text, _ in samples]
    as_bytes = one_file(tmp_path / "bytes" / "data.parquet", image=targets, text=texts,
                        control_image=[[c.read_bytes() for c in controls] for *_, controls in samples])
    read_back, _ = read("edit-pairs", as_bytes, "parquet")
    assert [[read_bytes(c) for c in s.controls] for s in read_back] == expected
    assert MEMBERS.member(read_back[0].controls[1]).place == "row 0 column control_image[1]"
    as_paths = one_file(loose / "index.parquet", image=targets, text=texts,
                        control_image=[[c.relative_to(loose).as_posix() for c in controls] for *_, controls in samples])
    read_back, _ = read("edit-pairs", as_paths, "parquet")
    assert [list(s.controls) for s in read_back] == [list(controls) for *_, controls in samples], "the loose files"


def test_the_trainer_reads_exactly_the_layouts_the_api_lets_each_format_hold():
    stored = {name for name, layout in LAYOUTS.items() if layout.from_stored is not None}
    for name in DATA_FORMATS:
        assert set(stored_as(name)) == (set(LAYOUTS) if name == "files" else stored), name


def truncate_last_member(root: Path) -> Path:
    shard = sorted(root.glob("*.tar"))[-1]
    data = shard.read_bytes()
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-2]  # the last sample's image (its caption follows)
    shard.write_bytes(data[:last.offset_data + last.size // 2])
    return shard


def non_image_row(root: Path) -> Path:
    file = sorted(root.glob("*.parquet"))[0]
    table = pq.read_table(file)
    images = table.column("image").to_pylist()
    images[1] = {"bytes": b"<html>not an image</html>", "path": images[1]["path"]}
    pq.write_table(table.set_column(0, "image", pa.array(images, table.schema.field("image").type)), file)
    return file


def test_a_parquet_file_without_the_named_column_is_named_with_the_columns_it_has(tmp_path):
    root = write_parquet("captions", write_tiny_data("captions", tmp_path / "loose", count=4, size=32), tmp_path / "pq")
    with pytest.raises(ConfigError) as refused:
        read("captions", root, "parquet", captionColumn="prompt")
    assert str(refused.value) == (f"{root / 'train-00000.parquet'}: no column 'prompt' (spec.data.captionColumn); "
                                  "its columns are image, text: name the right one in spec.data.captionColumn")


def test_a_shard_truncated_mid_member_is_refused_naming_the_member_or_skipped(tmp_path):
    root = write_webdataset("captions", write_tiny_data("captions", tmp_path / "loose", count=8, size=32),
                            tmp_path / "wd")
    shard = truncate_last_member(root)
    with pytest.raises(ConfigError, match=rf"^{shard} member 0007.png: is cut off after \d+ of its \d+ bytes \(the "
                                          r"shard is truncated\); write or upload the shard again; fix or remove it, "
                                          r"or set spec.data.skipBad: true to skip bad samples$"):
        read("captions", root, "webdataset")
    samples, screen = read("captions", root, "webdataset", skip_bad=True)
    assert len(samples) == 7 and len(screen.skipped) == 1, "the samples before the cut train"


def test_an_image_column_holding_other_bytes_is_named_by_file_and_row_or_skipped(tmp_path):
    root = write_parquet("captions", write_tiny_data("captions", tmp_path / "loose", count=8, size=32), tmp_path / "pq")
    file = non_image_row(root)
    samples, _ = read("captions", root, "parquet")
    with pytest.raises(ConfigError, match=rf"^{file} row 1: cannot be read as an image \(UnidentifiedImageError"):
        Screen(skip_bad=False).images(samples)
    screen = Screen(skip_bad=True)
    assert len(screen.images(samples)) == 7 and screen.skipped[0].startswith(f"{file} row 1: ")


def test_a_format_that_cannot_hold_the_layout_is_refused_naming_what_it_holds():
    with pytest.raises(ValidationError, match="spec.data.format does not fit spec.data.layout: .*parquet stores "
                                              "captions, edit-pairs, image-folder"):
        DataSpec(layout="pmg", uri="/data", format="parquet")
    with pytest.raises(ValidationError, match="spec.data.labelColumn names the label column of the image-folder"):
        DataSpec(layout="captions", uri="/data", format="parquet", labelColumn="label")


def test_the_trainer_refuses_a_bad_row_in_one_line_before_writing_anything(tiny_sd15, tmp_path):
    root = write_parquet("captions", write_tiny_data("captions", tmp_path / "loose", count=8, size=32), tmp_path / "pq")
    file = non_image_row(root)
    manifest = family_job("sd15", "captions", tiny_sd15, root, tmp_path / "out", data={"format": "parquet"})
    result = run_trainer_on(write_manifest(manifest, tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{file} row 1: cannot be read as an image" in result.stderr and "spec.data.skipBad" in result.stderr
    assert no_traceback(result.stderr)
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"


def test_image_folder_as_webdataset_trains_the_classifier_class_folders_train(tiny_model, tiny_dataset, tmp_path):
    from tests.trainer.conftest import run_dir, run_trainer, trained_weights
    from tests.trainer.test_distributed import max_difference

    loose = tiny_dataset("image-folder")
    shards = write_webdataset("image-folder", loose, tmp_path / "shards", per_file=3)
    weights = {}
    for name, root, data_format in (("loose", loose, "files"), ("shards", shards, "webdataset")):
        manifest = family_job("classifier", "image-folder", tiny_model("classifier"), root, tmp_path / name,
                              data={"format": data_format, "randomFlip": True, "centerCrop": False})
        run_trainer(manifest, tmp_path)
        weights[name] = trained_weights(run_dir(tmp_path / name) / "checkpoint-2")
    assert max_difference(weights["loose"], weights["shards"]) == 0


@pytest.mark.parametrize("data_format", WRITERS)
def test_edit_pairs_with_more_control_images_than_the_family_takes_are_named_by_row_or_sample(data_format,
                                                                                            tmp_path):
    loose = write_tiny_data("edit-pairs", tmp_path / "loose", count=4, size=32, seed=0, references=(1, 3))
    stored = WRITERS[data_format]("edit-pairs", loose, tmp_path / data_format)
    spec = spec_for("edit-pairs", stored, data_format).model_copy(update={"model": spec_for(
        "captions", stored, data_format).model.model_copy(update={"family": "flux-kontext"})})
    where = {"parquet": f"{stored / 'train-00000.parquet'} row 1",
             "webdataset": f"{stored / 'shard-00000.tar'} sample training_images/0001"}[data_format]
    with pytest.raises(ConfigError, match=rf"^{where}: has 3 control images; spec.model.family flux-kontext "
                                          "takes at most 1"):
        LAYOUTS["edit-pairs"].read_samples(spec, Screen(skip_bad=False))
    samples = LAYOUTS["edit-pairs"].read_samples(spec, screen := Screen(skip_bad=True))
    assert len(samples) == 2 and len(screen.skipped) == 2 and screen.skipped[0].startswith(f"{where}: ")  # 1, 3, 1, 3
