"""Where one run's checkpoints live: a local directory, mirrored to S3 when the URI is s3://.

Training always writes a checkpoint to local disk first; with an s3:// URI the background
uploader then writes its manifest locally, uploads its files and, last, the manifest, so a reader
of the bucket never sees a checkpoint whose files are not all there. Until its upload is done a
checkpoint is protected from local pruning; the newest checkpoint counts as published (for
status.latestCheckpoint) only once it is complete in the bucket.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

from kubetune_api import layout
from kubetune_trainer import checkpoints
from kubetune_trainer.storage import s3
from kubetune_trainer.storage.tree import open_tree
from kubetune_trainer.storage.uploader import BackgroundUploader, Task
from kubetune_trainer.storage.uri import S3Location, is_s3, parse_s3

log = logging.getLogger(__name__)
Published = Callable[[int, "float | None", int], None]  # step, upload seconds (None: local), bytes


def staging_root() -> Path:
    return Path(os.environ.get("KUBETUNE_STAGING_DIR", Path.home() / ".cache" / "kubetune" / "staging"))


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
    def __init__(self, uri: str, staging: Path | None = None, on_published: Published = lambda *a: None,
                 on_pending: Callable[[int], None] = lambda count: None):
        self.uri = uri
        self.remote: S3Location | None = parse_s3(uri) if is_s3(uri) else None
        self.local = local_path_for(uri, staging)
        self.on_published = on_published
        self.uploader = BackgroundUploader(on_pending=on_pending) if self.remote else None
        self._uploading: set[Path] = set()  # saved locally, not yet in the bucket
        self._lock = threading.Lock()

    def publish_checkpoint(self, path: Path, step: int, epoch: int, loss: float | None, keep_last: int) -> int:
        """A checkpoint whose files are all written: its manifest (sizes, sha256) makes it complete.
        Returns its size in bytes.

        Locally that happens now. Bound for S3 it happens on the upload thread, and the upload
        follows (files, then the manifest): hashing a large checkpoint takes seconds that
        training need not wait for. Until then the directory has no manifest, so nothing
        resumes from it and local pruning leaves it alone (it is the newest).
        """
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if self.remote is None:
            checkpoints.write_manifest(path, step, epoch, loss)
            checkpoints.prune(self.local, keep_last)
            self.on_published(step, None, size)
            return size
        with self._lock:
            self._uploading.add(path)

        def upload() -> None:
            if not (path / checkpoints.MANIFEST).is_file():  # a retry finds it written already
                checkpoints.write_manifest(path, step, epoch, loss)
            self._upload_checkpoint(path, keep_last)

        def uploaded(seconds: float) -> None:
            self._release(path, keep_last)
            self.on_published(step, seconds, size)

        self.uploader.submit(Task(path.name, upload, on_done=uploaded,
                                  on_skipped=lambda: self._release(path, keep_last), supersedable=True,
                                  group="checkpoint"))
        return size

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
        """Wait for every queued upload; False if the timeout came first."""
        return True if self.uploader is None else self.uploader.flush(timeout)

    def close(self, wait: bool = True) -> None:
        if self.uploader is not None:
            self.uploader.close(wait)

    def _upload_checkpoint(self, path: Path, keep_last: int) -> None:
        target = self.remote.child(path.name)
        files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.name != checkpoints.MANIFEST]
        s3.upload_files(files, path, target)
        s3.upload_file(path / checkpoints.MANIFEST, target.child(checkpoints.MANIFEST))
        # keep-last-K in the bucket: only complete checkpoints count, so the newest always stays.
        for step in complete_steps(s3.list_objects(self.remote))[:-keep_last]:
            old = self.remote.child(layout.checkpoint_name(step))
            s3.delete_object(old.child(checkpoints.MANIFEST))  # first: incomplete = invisible to readers
            s3.delete_prefix(old)

    def _release(self, path: Path, keep_last: int) -> None:
        with self._lock:
            self._uploading.discard(path)
            protected = set(self._uploading)
        checkpoints.prune(self.local, keep_last, protect=protected)
