"""Checkpoint directories count only when their manifest is written and matches the files."""
import json

from kubetune_trainer.checkpoint import files as checkpoints
from kubetune_trainer.checkpoint.store import newest_intact


def newest_step(root) -> int | None:
    """The step a run in `root` resumes from (newest_intact works on local and s3:// runs)."""
    uri = newest_intact(str(root))
    return None if uri is None else int(uri.rsplit("-", 1)[1])


def make_checkpoint(root, step, complete=True):
    path = checkpoints.checkpoint_dir(root, step)
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(bytes([step % 256]) * 100)
    if complete:
        files = checkpoints.describe_files(path, [path / "weights.bin"])
        checkpoints.write_manifest(path, step=step, epoch=0, loss=0.5, files=files)
    return path


def test_manifest_lists_files_with_sizes_and_checksums(tmp_path):
    path = make_checkpoint(tmp_path, 10)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 10
    assert manifest["files"]["weights.bin"]["size"] == 100
    assert len(manifest["files"]["weights.bin"]["sha256"]) == 64


def test_resume_skips_a_checkpoint_without_manifest(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, complete=False)
    assert newest_step(tmp_path) == 2


def test_resume_falls_back_when_a_file_is_corrupt(tmp_path, caplog):
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 4)
    (newest / "weights.bin").write_bytes(b"\0" * 100)
    assert newest_step(tmp_path) == 2
    assert "does not match its checksum" in caplog.text


def test_resume_falls_back_when_a_file_is_missing(tmp_path, caplog):
    make_checkpoint(tmp_path, 2)
    (make_checkpoint(tmp_path, 4) / "weights.bin").unlink()
    assert newest_step(tmp_path) == 2
    assert "weights.bin is missing" in caplog.text


def test_steps_sort_numerically_not_by_name(tmp_path):
    for step in (9, 10, 100):
        make_checkpoint(tmp_path, step)
    assert newest_step(tmp_path) == 100


def test_prune_keeps_the_newest_complete_and_drops_stale_partials(tmp_path):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 3, complete=False)  # crash leftover, older than the newest complete
    make_checkpoint(tmp_path, 8, complete=False)  # newer than every complete one: left alone
    checkpoints.prune(tmp_path, keep_last=2)
    assert [s for s, _ in checkpoints.checkpoint_steps(tmp_path)] == [4, 6, 8]


def test_no_checkpoints_means_a_fresh_start(tmp_path):
    assert newest_step(tmp_path / "missing") is None
