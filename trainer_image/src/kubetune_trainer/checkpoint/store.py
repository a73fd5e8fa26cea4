"""Where one run's checkpoints live: a local directory, mirrored to S3 when the URI is s3://.

Every process writes its share of a checkpoint (its shards, its random state; the main process
also the rest) to its node's disk. In the background, each process then hashes its files,
uploads them (s3:// runs) and records them in `parts/rank-<R>.json`; the main process waits
for every rank's record and writes the manifest, last. So a checkpoint counts only when every
rank's files are in place: a rank that dies mid-save leaves one without a manifest, which
nothing resumes from and pruning removes. The newest checkpoint counts as published (for
status.latestCheckpoint) only once its manifest is where the run's checkpoints live.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from kubetune_api import layout
from kubetune_api.contract import TrainerEnv
from kubetune_trainer.checkpoint import files as checkpoints
from kubetune_trainer.storage import s3
from kubetune_trainer.storage.tree import open_tree
from kubetune_trainer.storage.uploader import BackgroundUploader, Task
from kubetune_trainer.storage.uri import S3Location, is_s3, parse_s3

log = logging.getLogger(__name__)
Published = Callable[[int, "float | None", int], None]  # step, upload seconds (None: local), bytes
PARTS_DIR = "parts"
PART_WAIT_SECONDS = 60  # then the wait is retried by the uploader, with its pauses and time limit


def part_name(rank: int) -> str:
    return f"{PARTS_DIR}/rank-{rank}.json"


class PartsMissing(RuntimeError):
    """Some ranks have not recorded their part of a checkpoint yet (retried)."""


def merge_parts(records: dict[int, dict], world_size: int) -> dict[str, dict] | None:
    """Every file of a checkpoint from its parts' records; None if a rank skipped its part.

    Raises PartsMissing while a rank's record is not there yet.
    """
    missing = sorted(set(range(world_size)) - set(records))
    if missing:
        raise PartsMissing(f"waiting for the part of rank(s) {missing[:8]}")
    if any(record.get("skipped") for record in records.values()):
        return None
    files: dict[str, dict] = {}
    for rank in sorted(records):
        files.update(records[rank]["files"])
    return files


def staging_root() -> Path:
    return Path(TrainerEnv.from_env(os.environ).staging_dir or Path.home() / ".cache" / "kubetune" / "staging")


def local_path_for(uri: str, staging: Path | None = None) -> Path:
    """Where an s3:// URI is mirrored on this machine (a local path stands for itself)."""
    if not is_s3(uri):
        return Path(uri)
    location = parse_s3(uri)
    return (staging or staging_root()) / location.bucket / location.key


def complete_steps(files: dict[str, int]) -> list[int]:
    """Steps of the checkpoints whose manifest is among `files` (relative paths), oldest first."""
    steps = set()
    for name in files:
        folder, _, leaf = name.partition("/")
        step = layout.parse_checkpoint(folder)
        if step is not None and leaf == checkpoints.MANIFEST:
            steps.add(step)
    return sorted(steps)


def fetch_intact(uri: str, staging: Path | None = None) -> tuple[Path | None, str]:
    """A local, verified copy of the checkpoint at uri; (None, the reason) when it is not whole."""
    try:
        local = open_tree(uri).download(local_path_for(uri, staging))
    except FileNotFoundError:
        return None, "nothing is there"
    manifest, problem = checkpoints.verify(local)
    return (local, "") if manifest is not None else (None, problem)


def newest_intact(run_uri: str, staging: Path | None = None) -> str | None:
    """URI of the newest checkpoint of a run that is complete and intact (now also fetched locally)."""
    tree = open_tree(run_uri)
    for step in reversed(complete_steps(tree.files())):
        uri = layout.join(run_uri, layout.checkpoint_name(step))
        local, problem = fetch_intact(uri, staging)
        if local is not None:
            return uri
        log.warning("skipping %s: %s; falling back to an older checkpoint", uri, problem)
    return None


class CheckpointStore:
    """One process's view of its run's checkpoints (rank 0 is the main process)."""

    def __init__(self, uri: str, staging: Path | None = None, on_published: Published = lambda *a: None,
                 on_pending: Callable[[int], None] = lambda count: None, rank: int = 0, world_size: int = 1):
        self.uri = uri
        self.remote: S3Location | None = parse_s3(uri) if is_s3(uri) else None
        self.local = local_path_for(uri, staging)
        self.rank, self.world_size = rank, world_size
        self.on_published = on_published
        # Local runs use the thread too: hashing and waiting for the other ranks happen off training.
        self.uploader = BackgroundUploader(on_pending=on_pending)
        self._unpublished: set[Path] = set()  # saved locally, manifest not yet where it belongs
        self._lock = threading.Lock()

    # --- checkpoints ----------------------------------------------------------------------------

    def publish_part(self, path: Path, step: int, files: Callable[[], list[Path]],
                     written: Callable[[], None] = lambda: None) -> None:
        """Queue this process's share of a checkpoint: once `written()` returns, `files()` are all on
        disk; they are then hashed, uploaded (s3://) and recorded in parts/rank-<R>.json."""
        self._protect(path)

        def record_part() -> None:
            written()
            mine = files()
            record = {"step": step, "files": checkpoints.describe_files(path, mine)}
            if self.remote is not None:
                target = self.remote.child(path.name)
                s3.upload_files(mine, path, target)
                s3.write_text(target.child(part_name(self.rank)), json.dumps(record))
            checkpoints.write_json_atomically(path / part_name(self.rank), record)
            if self.remote is not None and self.rank != 0:
                for file in mine:  # in the bucket now; a restarted pod starts from a new disk anyway
                    file.unlink(missing_ok=True)

        def record_skip() -> None:
            skip = {"step": step, "skipped": True}
            if self.remote is not None:
                s3.write_text(self.remote.child(path.name, part_name(self.rank)), json.dumps(skip))
            checkpoints.write_json_atomically(path / part_name(self.rank), skip)

        self.uploader.submit(Task(f"{path.name} (rank {self.rank})", record_part, supersedable=self.remote is not None,
                                  group="checkpoint part", on_skipped=lambda: self._release(path, None),
                                  if_superseded=Task(f"{path.name} skipped (rank {self.rank})", record_skip)))

    def complete_checkpoint(self, path: Path, step: int, epoch: int, loss: float | None, keep_last: int,
                            validation: dict | None = None) -> None:
        """Main process: once every rank recorded its part, write the manifest (last) and prune."""
        sizes: list[int] = []

        def complete() -> None:
            files = self._wait_for_parts(path)
            if files is None:
                log.info("%s: a newer checkpoint came first on some rank; this one stays incomplete", path.name)
                return
            checkpoints.write_manifest(path, step, epoch, loss, files, validation)
            sizes.append(sum(entry["size"] for entry in files.values()))
            if self.remote is not None:
                s3.upload_file(path / checkpoints.MANIFEST, self.remote.child(path.name, checkpoints.MANIFEST))
                self._prune_remote(keep_last)

        def completed(seconds: float) -> None:
            self._release(path, keep_last)
            if sizes:
                self.on_published(step, seconds if self.remote is not None else None, sizes[0])

        self.uploader.submit(Task(f"{path.name} manifest", complete, on_done=completed,
                                  on_skipped=lambda: self._release(path, keep_last),
                                  supersedable=self.remote is not None, group="checkpoint manifest"))

    def publish_checkpoint(self, path: Path, step: int, epoch: int, loss: float | None, keep_last: int) -> None:
        """A checkpoint one process wrote whole (world size 1): its part, then its manifest."""
        assert self.world_size == 1, "several processes publish parts, and the main one completes"
        self.publish_part(path, step, lambda: [f for f in path.rglob("*") if f.is_file() and PARTS_DIR not in f.parts])
        self.complete_checkpoint(path, step, epoch, loss, keep_last)

    def _wait_for_parts(self, path: Path) -> dict[str, dict] | None:
        deadline = time.monotonic() + PART_WAIT_SECONDS
        while True:
            try:
                return merge_parts(self._read_parts(path), self.world_size)
            except PartsMissing:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _read_parts(self, path: Path) -> dict[int, dict]:
        if self.remote is None:
            texts = {int(f.stem.removeprefix("rank-")): f.read_text() for f in (path / PARTS_DIR).glob("rank-*.json")}
        else:
            parts = self.remote.child(path.name, PARTS_DIR)
            texts = {int(Path(name).stem.removeprefix("rank-")): s3.read_text(parts.child(name))
                     for name in s3.list_objects(parts) if name.startswith("rank-") and name.endswith(".json")}
        return {rank: json.loads(text) for rank, text in texts.items() if text is not None}

    def _prune_remote(self, keep_last: int) -> None:
        """keep-last-K complete checkpoints in the bucket (the newest always stays), and drop the
        incomplete ones older than the newest complete one (superseded or crashed saves)."""
        objects = s3.list_objects(self.remote)
        complete = complete_steps(objects)
        present = {step for name in objects
                   if (step := layout.parse_checkpoint(name.partition("/")[0])) is not None}
        stale = complete[:-keep_last] + [s for s in present - set(complete) if complete and s < complete[-1]]
        for step in sorted(stale):
            old = self.remote.child(layout.checkpoint_name(step))
            s3.delete_object(old.child(checkpoints.MANIFEST))  # first: incomplete = invisible to readers
            s3.delete_prefix(old)

    def _protect(self, path: Path) -> None:
        with self._lock:
            self._unpublished.add(path)

    def _release(self, path: Path, keep_last: int | None) -> None:
        with self._lock:
            self._unpublished.discard(path)
            protected = set(self._unpublished)
        if keep_last is not None and self.rank == 0:
            checkpoints.prune(self.local, keep_last, protect=protected)

    # --- other files (main process) -------------------------------------------------------------

    def publish_files(self, files: list[Path], name: str) -> None:
        """Upload files under the local root (final weights, logs); a flush waits for them."""
        if self.remote is not None and files:
            self.uploader.submit(Task(name, lambda: s3.upload_files(files, self.local, self.remote), required=True))

    def mirror(self, folder: str) -> None:
        """Make <remote>/<folder> match the local folder (TensorBoard logs, best/, samples/) while
        the run goes on: changed files uploaded, files gone locally deleted. Queued, so it never
        runs beside a checkpoint upload; a newer mirror of the same folder replaces a waiting one."""
        if self.remote is not None:
            self.uploader.submit(Task(f"{folder}/", lambda: self._mirror(folder), supersedable=True,
                                      group=folder))

    def fetch_folder(self, folder: str) -> None:
        """Bring <remote>/<folder> to local disk (a restarted pod picking up best/)."""
        if self.remote is not None and s3.list_objects(self.remote.child(folder)):
            s3.download_prefix(self.remote.child(folder), self.local / folder)

    def _mirror(self, folder: str) -> None:
        local = self.local / folder
        remote = self.remote.child(folder)
        present = {str(p.relative_to(local)): p for p in local.rglob("*") if p.is_file()} if local.is_dir() else {}
        uploaded = s3.list_objects(remote)
        changed = [p for name, p in present.items() if uploaded.get(name) != p.stat().st_size]
        s3.upload_files(changed, local, remote)
        for gone in set(uploaded) - set(present):
            s3.delete_object(remote.child(gone))

    def write_text(self, name: str, text: str, required: bool = False) -> None:
        """A small file at the run's root (run.json): written locally, then uploaded in turn."""
        open_tree(str(self.local)).write_text(name, text)
        if self.remote is not None:
            target = self.remote.child(name)
            self.uploader.submit(Task(name, lambda: s3.write_text(target, text), required=required))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued task; False if the timeout came first."""
        return self.uploader.flush(timeout)

    def close(self, wait: bool = True) -> None:
        self.uploader.close(wait)
