"""Names chosen by whoever writes a bucket or a manifest stay inside their root."""
import os

import pytest

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.confine import UnsafePath, confined
from kubetune_trainer.storage.uri import parse_s3


@pytest.mark.parametrize("name", ["../escape.txt", "a/../../b", "/etc/passwd", ""])
def test_names_that_climb_out_or_are_absolute_are_refused(tmp_path, name):
    with pytest.raises(UnsafePath, match="leaves"):
        confined(tmp_path, name, "key")


def test_a_windows_path_is_refused_with_the_name_it_meant(tmp_path):
    """metadata.jsonl written on Windows; "a\\..\\b" would climb on a reader that splits on backslashes."""
    with pytest.raises(UnsafePath, match=r"file_name 'images\\\\a.png' holds a backslash: separate folders with "
                                         r"'/' \('images/a.png'\)"):
        confined(tmp_path, "images\\a.png", "file_name")
    with pytest.raises(UnsafePath, match="holds a backslash"):
        confined(tmp_path, "a\\..\\b", "key")


def test_a_symlink_inside_the_root_may_not_lead_out(tmp_path):
    (tmp_path / "data").mkdir()
    os.symlink("/etc", tmp_path / "data" / "out")
    with pytest.raises(UnsafePath, match="through a symbolic link"):
        confined(tmp_path, "data/out/hostname", "file name")
    assert confined(tmp_path, "data/ok.png", "file name") == tmp_path / "data" / "ok.png"
    os.symlink(tmp_path / "data", tmp_path / "also-data")  # a symlink that stays inside is fine
    assert confined(tmp_path, "also-data/ok.png", "file name") == tmp_path / "also-data" / "ok.png"
    os.symlink("/etc/hostname", tmp_path / "data" / "leaf")  # the last part a symlink out
    with pytest.raises(UnsafePath, match="through a symbolic link"):
        confined(tmp_path, "data/leaf", "file name")


def test_a_root_reached_through_a_symlink_is_its_own_inside(tmp_path):
    """The root itself may be a symlink (a mounted cache): names below it are inside it."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "root")
    assert confined(tmp_path / "root", "a/b.png", "file name") == tmp_path / "root" / "a" / "b.png"
    os.symlink(tmp_path, tmp_path / "real" / "up")
    with pytest.raises(UnsafePath, match="through a symbolic link"):
        confined(tmp_path / "root", "up/x", "file name")


def test_a_bucket_key_with_dot_dot_is_refused_before_anything_is_downloaded(tmp_path, monkeypatch):
    downloaded = []
    monkeypatch.setattr(s3, "list_stored_objects", lambda location: {
        "ok.bin": s3.StoredObject(1, 0), "../../.bashrc": s3.StoredObject(5, 0)})
    monkeypatch.setattr(s3, "download_file", lambda location, target, *_: downloaded.append(target))
    with pytest.raises(UnsafePath, match=r"object key under s3://bucket/models '../../.bashrc' leaves"):
        s3.download_prefix(parse_s3("s3://bucket/models"), tmp_path / "mirror")
    assert downloaded == [], "refused before the first download"
    assert not (tmp_path.parent / ".bashrc").exists()
