"""What a job's directory holds, for people: runs, their complete checkpoints, final weights.

Read-only and torch-free: `kubetune checkpoints ls/pull` uses it from a laptop. Only checkpoints
whose manifest is there are listed — an upload in progress is invisible until it is whole.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kubetune_api import layout
from kubetune_trainer.checkpoint import files as checkpoints
from kubetune_trainer.checkpoint import runs
from kubetune_trainer.checkpoint.store import complete_steps
from kubetune_trainer.storage.tree import open_tree


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    epoch: int | None
    loss: float | None
    saved_at: float | None
    size: int
    uri: str


@dataclass(frozen=True)
class RunEntry:
    version: int | None  # None: a directory that is not under a v<N>
    uri: str
    record: runs.RunRecord
    checkpoints: list[CheckpointEntry]
    final_files: dict[str, int]  # the weights at the run's root, once it finished

    def checkpoint(self, step: int) -> CheckpointEntry | None:
        return next((c for c in self.checkpoints if c.step == step), None)


def readable_manifest(text: str | None) -> dict | None:
    """A manifest's content when it has the shape the trainer writes, else None."""
    try:
        manifest = json.loads(text or "")
        if isinstance(manifest, dict) and all(isinstance(f, dict) and isinstance(f.get("size"), int)
                                              for f in manifest["files"].values()):
            return manifest
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        pass
    return None


def describe_run(uri: str, version: int | None) -> RunEntry:
    tree = open_tree(uri)
    files = tree.files()
    entries = []
    for step in complete_steps(files):
        name = layout.checkpoint_name(step)
        manifest = readable_manifest(tree.child(name).read_text(checkpoints.MANIFEST))
        if manifest is None:
            continue  # a damaged manifest: not a checkpoint anyone can resume or pull
        size = sum(f["size"] for f in manifest["files"].values())
        entries.append(CheckpointEntry(step, manifest.get("epoch"), manifest.get("loss"), manifest.get("time"),
                                       size, layout.join(uri, name)))
    record = runs.parse_record(version if version is not None else -1, tree.read_text(layout.RUN_FILE))
    return RunEntry(version, uri, record, entries, final_weights(files) if record.finished else {})


def final_weights(files: dict[str, int]) -> dict[str, int]:
    """The final weights among a run's files: those at its root but the records (a LoRA, an adapter), and
    the model folders a full fine-tune writes (unet/, transformer/: a folder with a config.json)."""
    model_folders = {name.split("/")[0] for name in files
                     if name.count("/") == 1 and name.endswith("/config.json")
                     and layout.parse_checkpoint(name.split("/")[0]) is None}
    return {name: size for name, size in files.items()
            if ("/" not in name and name not in layout.RUN_RECORDS) or name.split("/")[0] in model_folders}


def describe(uri: str) -> list[RunEntry]:
    """Every run under a job directory, or the one run when uri is a run's own directory."""
    tree = open_tree(uri)
    versions = sorted(v for v in map(layout.parse_version, tree.children()) if v is not None)
    if versions:
        return [describe_run(layout.join(uri, layout.version_name(v)), v) for v in versions]
    own = layout.parse_version(uri.rstrip("/").rsplit("/", 1)[-1])
    run = describe_run(uri, own)
    return [run] if run.checkpoints or run.final_files or tree.read_text(layout.RUN_FILE) else []


def human_size(size: int) -> str:
    """A byte count as people read it: 512 B, 1.5 KiB ... GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


class PullFailed(RuntimeError):
    """A download that could not be verified (nothing of it is left in the target)."""


class DestinationTaken(PullFailed):
    """The target holds a link or a file the pull would replace: the user's to resolve (bad input,
    exit 2), where a download that did not arrive intact is the store's (exit 1)."""


def pull_checkpoint(entry: CheckpointEntry, target: Path, force: bool = False) -> list[Path]:
    """Download one checkpoint, check every file against its manifest, then move it into target:
    a pull that fails leaves nothing unverified behind, and replaces a file already in target only
    with force."""
    tree = open_tree(entry.uri)
    names = sorted(tree.files())
    check_destinations(names, target, force)
    with _staging_beside(target) as staging:
        tree.fetch(names, staging)
        manifest, problem = checkpoints.verify(staging)
        if manifest is None:
            raise PullFailed(f"{entry.uri} did not arrive intact: {problem}")
        return move_into(staging, target, force)


def pull_final(run: RunEntry, target: Path, force: bool = False) -> list[Path]:
    """Download the final weights (the files at the run's root)."""
    names = sorted(run.final_files)
    check_destinations(names, target, force)
    with _staging_beside(target) as staging:
        open_tree(run.uri).fetch(names, staging)
        return move_into(staging, target, force)


def check_destinations(names: list[str], target: Path, force: bool) -> None:
    """Before anything is downloaded: no file of the user's in target is replaced without force, and
    nothing is written through a symbolic link inside target (a folder linked elsewhere would take
    the files out of target; a linked file would be replaced, not its target written)."""
    clashes = []
    for name in names:
        destination = target / name
        for place in [*reversed(destination.relative_to(target).parents), Path(name)][1:]:
            if (target / place).is_symlink():
                raise DestinationTaken(f"{target / place} is a symbolic link: kubetune never writes through one; "
                                       "remove it or pull into another folder")
        if destination.exists():
            clashes.append(name)
    if clashes and not force:
        more = f" and {len(clashes) - 1} more" if len(clashes) > 1 else ""
        raise DestinationTaken(f"{target} already holds {clashes[0]}{more}: pass --force to replace them, "
                               "or pull into another folder")


@contextmanager
def _staging_beside(target: Path):
    """A temporary directory on target's file system (moves are renames), always removed."""
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".kubetune-pull-", dir=target))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def move_into(staging: Path, target: Path, force: bool) -> list[Path]:
    """Every file of `staging` to the same place under `target` (renames: staging sits beside it),
    checked by check_destinations once more just before."""
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    check_destinations([str(f.relative_to(staging)) for f in files], target, force)  # again: as late as can be
    moved = []
    for file in files:
        destination = target / file.relative_to(staging)
        destination.parent.mkdir(parents=True, exist_ok=True)
        file.replace(destination)
        moved.append(destination)
    return moved
