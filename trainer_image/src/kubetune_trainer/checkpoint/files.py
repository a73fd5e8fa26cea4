"""Checkpoint directories: `checkpoint-<step>/` with a manifest written last.

A checkpoint counts only when its manifest exists and every file it lists has the recorded size
and checksum, so a run killed mid-save never resumes from half a checkpoint (which one a run
resumes from: checkpoint.store.newest_intact, for local and s3:// runs alike).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from kubetune_api import layout
from kubetune_trainer.storage.confine import UnsafePath, confined

MANIFEST = "manifest.json"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / layout.checkpoint_name(step)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(path: Path, files: list[Path]) -> dict[str, dict]:
    """Size and sha256 of each file, by its path relative to the checkpoint."""
    return {str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": sha256_of(f)} for f in sorted(files)}


def write_json_atomically(target: Path, content: dict) -> None:
    partial = target.with_name(target.name + ".tmp")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps(content, indent=1))
    partial.replace(target)


def write_manifest(path: Path, step: int, epoch: int, loss: float | None, files: dict[str, dict],
                   validation: dict | None = None) -> dict:
    """The manifest of a checkpoint whose `files` (from describe_files) are all written: last, atomically.
    VALIDATION: the latest validation at or before this step ({step, metrics}), when there was one."""
    manifest = {"step": step, "epoch": epoch, "loss": loss, "time": time.time(), "files": files}
    if validation:
        manifest["validation"] = validation
    write_json_atomically(path / MANIFEST, manifest)
    return manifest


def verify(path: Path) -> tuple[dict | None, str]:
    """The manifest if the checkpoint is complete and intact, else None and the reason."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        entries = [(name, int(expected["size"]), str(expected["sha256"])) for name, expected in files.items()]
    except FileNotFoundError:
        return None, "no manifest (save did not finish)"
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None, "unreadable manifest"
    for name, size, digest in entries:
        try:
            file = confined(path, name, "manifest entry")
        except UnsafePath as err:
            return None, str(err)
        if file.is_symlink():
            return None, f"{name} is a symbolic link (a checkpoint holds files only)"
        if not file.is_file():
            return None, f"{name} is missing"
        if file.stat().st_size != size:
            return None, f"{name} has {file.stat().st_size} bytes, manifest says {size}"
        if sha256_of(file) != digest:
            return None, f"{name} does not match its checksum"
    return manifest, ""


def checkpoint_steps(root: Path) -> list[tuple[int, Path]]:
    """Every checkpoint-<step> directory under root, oldest first, complete or not."""
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir()
             if p.is_dir() and (step := layout.parse_checkpoint(p.name)) is not None]
    return sorted(found)


def prune(root: Path, keep_last: int, protect: set[Path] = frozenset()) -> list[Path]:
    """Keep the newest `keep_last` complete checkpoints; drop older ones and stale partial saves.

    Partial directories older than the newest complete checkpoint are crash leftovers (a save in
    flight is always the newest). `protect`: checkpoints still waiting for their upload.
    """
    entries = checkpoint_steps(root)
    complete = [(s, p) for s, p in entries if (p / MANIFEST).is_file()]
    keep = {p for _, p in complete[-keep_last:]}
    newest_complete = complete[-1][0] if complete else -1
    removed = []
    for step, path in entries:
        if path in keep or path in protect or step > newest_complete:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
