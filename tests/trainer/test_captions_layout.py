"""The captions layout as people lay it out: other keys than file_name/text (spec.data.imageColumn,
captionColumn), images in an images/ folder beside metadata.jsonl (the SDXL LoRA guide's data sets),
a metadata.csv instead of metadata.jsonl, neither but each image's caption in NAME.txt (kohya,
ai-toolkit, musubi-tuner), and a warning for images smaller than the training size."""
from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from kubetune_trainer.data.captions import read_captions
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError


def write_set(root, names_and_sizes, keys=("file_name", "text"), folder="images"):
    (root / folder).mkdir(parents=True, exist_ok=True)
    lines = []
    for name, size in names_and_sizes:
        Image.new("RGB", size, "red").save(root / folder / name)
        lines.append(json.dumps({keys[0]: name, keys[1]: f"a photo of {name}"}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_the_sdxl_guides_layout_with_its_own_keys_reads(tmp_path):
    root = write_set(tmp_path, [("a.png", (64, 64)), ("b.png", (64, 64))], keys=("image", "prompt"))
    samples = read_captions(root, Screen(skip_bad=False), image_column="image", caption_column="prompt")
    assert [(s.path, s.caption) for s in samples] == [(root / "images" / "a.png", "a photo of a.png"),
                                                       (root / "images" / "b.png", "a photo of b.png")]


def test_a_key_the_lines_do_not_have_is_named_with_the_keys_they_have(tmp_path):
    root = write_set(tmp_path, [("a.png", (64, 64))], keys=("image", "prompt"))
    with pytest.raises(ConfigError, match=r"metadata.jsonl:1: no key 'file_name' \(expected \{\"file_name\": \.\.\., "
                                          r"\"text\": \.\.\.\}; spec.data.imageColumn and captionColumn name other "
                                          r"keys: this line has 'image', 'prompt'\)"):
        read_captions(root, Screen(skip_bad=False))


def test_an_images_folder_that_links_outside_the_data_set_is_refused(tmp_path):
    outside = write_set(tmp_path / "elsewhere", [("a.png", (64, 64))])
    root = tmp_path / "data"
    root.mkdir()
    (root / "metadata.jsonl").write_text((outside / "metadata.jsonl").read_text())
    os.symlink(outside / "images", root / "images")
    with pytest.raises(ConfigError, match="leads outside .* through a symbolic link"):
        read_captions(root, Screen(skip_bad=False))


def test_images_smaller_than_the_training_size_are_counted_with_the_smallest_named(tmp_path):
    root = write_set(tmp_path, [("big.png", (64, 64)), ("wide.png", (80, 24)), ("tiny.png", (16, 16))])
    screen = Screen(skip_bad=False)
    samples = screen.images(read_captions(root, screen), size=(32, 32))
    assert len(samples) == 3, "small images still train (upscaled)"
    assert screen.small.warning((32, 32)) == (
        f"2 of 3 images are smaller than the training size 32x32 and will be upscaled; the smallest is 16x16 "
        f"({root / 'images' / 'tiny.png'}); lower spec.data.resolution or replace them for sharper results")
    screen.images(read_captions(root, screen), size=(32, 32), by_area=True)
    assert (screen.small.count, screen.small.smallest) == (1, (16, 16)), "buckets keep the pixel count, not the sides"
    screen.images(read_captions(root, screen), size=(16, 16))
    assert screen.small is None


def test_a_width_by_height_training_size_crops_and_samples_at_that_size_from_caption_files(
        tiny_job, captions_data, tmp_path):
    from PIL import Image as PILImage

    from tests.trainer.conftest import run_dir, run_trainer

    manifest = tiny_job(maxSteps=2)
    manifest["spec"]["data"]["uri"] = str(as_caption_files(captions_data, tmp_path / "kohya"))
    manifest["spec"]["data"]["resolution"] = [48, 32]  # [width, height], as the Qwen/Kontext guide writes it
    manifest["spec"]["validation"] = {"everySteps": 2, "prompts": ["a red circle"], "numInferenceSteps": 1}
    result = run_trainer(manifest, tmp_path)
    assert "has no metadata.jsonl or metadata.csv: 8 images captioned by their NAME.txt files" in result.stderr
    assert "8 of 8 images are smaller than the training size 48x32" in result.stderr, "32x32 data: narrower"
    [sample] = (run_dir(tmp_path / "out") / "samples" / "step-0000002").glob("0.png")
    assert PILImage.open(sample).size == (48, 32)


def as_caption_files(source, root, folders=lambda name: ""):
    """The captions data set at SOURCE again as kohya / ai-toolkit / musubi-tuner keep one: each image
    with its caption in NAME.txt beside it, no metadata.jsonl; `folders` puts an image in a subfolder."""
    for line in (source / "metadata.jsonl").read_text().splitlines():
        record = json.loads(line)
        image = root / folders(record["file_name"]) / record["file_name"]
        image.parent.mkdir(parents=True, exist_ok=True)
        image.write_bytes((source / record["file_name"]).read_bytes())
        image.with_suffix(".txt").write_text(record["text"])
    return root


def test_images_with_their_caption_files_read_as_the_same_set_with_metadata_jsonl(tmp_path):
    source = write_set(tmp_path / "jsonl", [(f"{name}.png", (64, 64)) for name in "abcd"], folder=".")
    root = as_caption_files(source, tmp_path / "txt", folders=lambda name: "portraits" if name < "c" else "")
    (root / "portraits" / "b.txt").write_bytes("\ufeffa photo of b.png\r\n".encode())  # Notepad: a BOM, CRLF
    (root / "notes.txt").write_text("not a caption: no image is called notes")
    (root / ".thumbnails").mkdir()
    Image.new("RGB", (8, 8)).save(root / ".thumbnails" / "a.png")  # hidden: not a sample
    from_metadata = read_captions(source, Screen(skip_bad=False))
    from_files = read_captions(root, Screen(skip_bad=False))
    assert [(s.path.relative_to(root).as_posix(), s.caption) for s in from_files] == [
        ("c.png", "a photo of c.png"), ("d.png", "a photo of d.png"),
        ("portraits/a.png", "a photo of a.png"), ("portraits/b.png", "a photo of b.png")], "in path order"
    assert sorted(s.caption for s in from_files) == sorted(s.caption for s in from_metadata)


def test_an_image_without_its_caption_file_is_named_and_skipped_only_when_asked(tmp_path):
    root = as_caption_files(write_set(tmp_path / "jsonl", [("a.png", (64, 64)), ("b.png", (64, 64))], folder="."),
                            tmp_path / "txt")
    (root / "b.txt").unlink()
    (root / "a.txt").write_text("")  # an empty caption file is an empty caption, not a missing one
    with pytest.raises(ConfigError, match=rf"{root / 'b.png'}: no caption b.txt beside it \(without "
                                          r"metadata.jsonl or metadata.csv, each of the images needs NAME.txt; an empty one is "
                                          r"an empty caption\); fix or remove it, or set spec.data.skipBad"):
        read_captions(root, Screen(skip_bad=False))
    screen = Screen(skip_bad=True)
    assert [(s.path.name, s.caption) for s in read_captions(root, screen)] == [("a.png", "")]
    assert len(screen.skipped) == 1 and "b.png" in screen.skipped[0]


def test_caption_files_that_are_not_text_or_lead_outside_are_named(tmp_path):
    root = as_caption_files(write_set(tmp_path / "jsonl", [("a.png", (64, 64)), ("b.png", (64, 64))], folder="."),
                            tmp_path / "txt")
    (root / "a.txt").write_bytes(b"caf\xe9")  # Latin-1
    with pytest.raises(ConfigError, match=rf"{root / 'a.txt'}: not UTF-8 text \(byte 3\); save it as UTF-8"):
        read_captions(root, Screen(skip_bad=False))
    (root / "a.txt").unlink()
    (tmp_path / "secret.txt").write_text("outside the data set")
    os.symlink(tmp_path / "secret.txt", root / "a.txt")
    with pytest.raises(ConfigError, match=r"caption file 'a.txt' leads outside .* through a symbolic link"):
        read_captions(root, Screen(skip_bad=False))


def test_a_folder_with_neither_metadata_nor_caption_files_names_both_ways(tmp_path):
    from kubetune_trainer.data.video_captions import read_video_captions

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no metadata.jsonl or metadata.csv and no images \(.png, .jpg.*\) with a caption "
                                          r"NAME.txt beside them; the captions layout needs images plus "
                                          r"metadata.jsonl lines of \{\"file_name\": ..., \"text\": ...\}, or each"):
        read_captions(tmp_path / "empty", Screen(skip_bad=False))
    with pytest.raises(ConfigError, match=r"no clips \(.mp4, .*\) with a caption NAME.txt.*the video-captions layout"):
        read_video_captions(tmp_path / "empty", Screen(skip_bad=False))
    (tmp_path / "empty" / "walk.mp4").write_bytes(b"")  # read, not decoded: the screen's clip check decodes
    (tmp_path / "empty" / "walk.txt").write_text("a person walking")
    [clip] = read_video_captions(tmp_path / "empty", Screen(skip_bad=False))
    assert (clip.path.name, clip.caption) == ("walk.mp4", "a person walking")


def test_a_metadata_csv_reads_as_metadata_jsonl_reads_and_a_missing_column_is_named(tmp_path):
    import csv

    source = write_set(tmp_path / "jsonl", [("a.png", (64, 64)), ("b.png", (64, 64))], keys=("image", "prompt"))
    root = tmp_path / "csv"
    (root / "images").mkdir(parents=True)
    rows = [json.loads(line) for line in (source / "metadata.jsonl").read_text().splitlines()]
    rows[1]["prompt"] = 'a "quoted", two-line\ncaption'  # what a spreadsheet writes quoted
    for row in rows:
        (root / "images" / row["image"]).write_bytes((source / "images" / row["image"]).read_bytes())
    with open(root / "metadata.csv", "w", newline="", encoding="utf-8-sig") as table:  # Excel's BOM
        writer = csv.DictWriter(table, ["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    samples = read_captions(root, Screen(skip_bad=False), image_column="image", caption_column="prompt")
    assert [(s.path, s.caption) for s in samples] == [(root / "images" / "a.png", "a photo of a.png"),
                                                       (root / "images" / "b.png", 'a "quoted", two-line\ncaption')]
    with pytest.raises(ConfigError, match=r"metadata.csv: no column 'file_name' \(spec.data.imageColumn\); its "
                                          r"header has 'image', 'prompt': name the right one in spec.data.imageColumn"):
        read_captions(root, Screen(skip_bad=False))
    (root / "metadata.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"has both metadata.jsonl and metadata.csv; keep the one"):
        read_captions(root, Screen(skip_bad=False), image_column="image", caption_column="prompt")
    (root / "metadata.jsonl").unlink()
    (root / "metadata.csv").write_bytes(b"image,prompt\na.png,caf\xe9\n")
    with pytest.raises(ConfigError, match=r"metadata.csv: not UTF-8 text \(byte 22\); save it as UTF-8"):
        read_captions(root, Screen(skip_bad=False), image_column="image", caption_column="prompt")
    (root / "metadata.csv").write_text("image,prompt\na.png," + "x" * 200_000 + "\n")
    with pytest.raises(ConfigError, match=r"metadata.csv: not readable as CSV after line 1 \(field larger than field limit"):
        read_captions(root, Screen(skip_bad=False), image_column="image", caption_column="prompt")
