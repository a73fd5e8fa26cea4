"""Where checkpoints live: a local directory, mirrored to S3 when the URI is s3://.

Training always writes checkpoints to local disk first (fast, and what resume reads); with an
s3:// URI each complete checkpoint is then uploaded with its manifest last, so a reader of the
bucket never sees a checkpoint whose files are not all there.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from kubetune_trainer import checkpoints
from kubetune_trainer.storage import s3
from kubetune_trainer.storage.uri import S3Location, is_s3, parse_s3

log = logging.getLogger(__name__)


class CheckpointStore:
    def __init__(self, uri: str, staging: Path | None = None):
        self.uri = uri
        self.remote: S3Location | None = parse_s3(uri) if is_s3(uri) else None
        if self.remote is None:
            self.local = Path(uri)
        else:
            base = staging or Path(os.environ.get("KUBETUNE_STAGING_DIR", Path.home() / ".cache" / "kubetune" / "staging"))
            self.local = base / self.remote.bucket / self.remote.key

    def publish(self, path: Path) -> None:
        """Upload one complete checkpoint directory: every file, then its manifest."""
        if self.remote is None:
            return
        target = self.remote.child(path.name)
        files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.name != checkpoints.MANIFEST]
        s3.upload_files(files, path, target)
        s3.upload_file(path / checkpoints.MANIFEST, target.child(checkpoints.MANIFEST))

    def publish_files(self, files: list[Path]) -> None:
        """Upload files that sit directly under the local root (the final weights, logs)."""
        if self.remote is not None:
            s3.upload_files(files, self.local, self.remote)

    def prune(self, keep_last: int) -> None:
        """Apply keep-last-K to the bucket too; only checkpoints with a manifest count as kept."""
        if self.remote is None:
            return
        steps = sorted(step for step, complete in self._remote_checkpoints().items() if complete)
        for step in steps[:-keep_last]:
            s3.delete_prefix(self.remote.child(f"checkpoint-{step}"))

    def fetch_latest(self) -> None:
        """Bring the newest complete remote checkpoint into the local directory (if not there)."""
        if self.remote is None:
            return
        for step, complete in sorted(self._remote_checkpoints().items(), reverse=True):
            if not complete:
                continue
            local = checkpoints.checkpoint_dir(self.local, step)
            s3.download_prefix(self.remote.child(local.name), local)
            manifest, problem = checkpoints.verify(local)
            if manifest is not None:
                log.info("fetched checkpoint %d from %s", step, self.remote.uri)
                return
            log.warning("remote checkpoint %d is damaged (%s); trying an older one", step, problem)

    def _remote_checkpoints(self) -> dict[int, bool]:
        """Step -> whether its manifest is there."""
        found = {}
        for name in s3.list_children(self.remote):
            if name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit():
                objects = s3.list_objects(self.remote.child(name))
                found[int(name[len("checkpoint-"):])] = checkpoints.MANIFEST in objects
        return found
