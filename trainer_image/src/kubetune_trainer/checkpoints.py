"""Checkpoint directories: `checkpoint-<step>/` with a manifest written last.

A checkpoint counts only when its manifest exists and every file it lists has the recorded size
and checksum, so a run killed mid-save never resumes from half a checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    manifest: dict


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"checkpoint-{step}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(path: Path, step: int, epoch: int, loss: float | None) -> dict:
    """Describe every file already in the checkpoint; written last, atomically (rename)."""
    files = {
        str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": sha256_of(f)}
        for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST and not f.name.endswith(".tmp")
    }
    manifest = {"step": step, "epoch": epoch, "loss": loss, "time": time.time(), "files": files}
    partial = path / (MANIFEST + ".tmp")
    partial.write_text(json.dumps(manifest, indent=1))
    partial.replace(path / MANIFEST)
    return manifest


def verify(path: Path) -> tuple[dict | None, str]:
    """The manifest if the checkpoint is complete and intact, else None and the reason."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, "no manifest (save did not finish)"
    except json.JSONDecodeError:
        return None, "unreadable manifest"
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return None, f"{name} is missing"
        if file.stat().st_size != expected["size"]:
            return None, f"{name} has {file.stat().st_size} bytes, manifest says {expected['size']}"
        if sha256_of(file) != expected["sha256"]:
            return None, f"{name} does not match its checksum"
    return manifest, ""


def checkpoint_steps(root: Path) -> list[tuple[int, Path]]:
    """Every checkpoint-<step> directory under root, oldest first, complete or not."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found)


def latest_complete(root: Path) -> Checkpoint | None:
    """The newest intact checkpoint; newer broken ones are reported and passed over."""
    for step, path in reversed(checkpoint_steps(root)):
        manifest, problem = verify(path)
        if manifest is not None:
            return Checkpoint(step, path, manifest)
        log.warning("skipping %s: %s; falling back to an older checkpoint", path, problem)
    return None


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
