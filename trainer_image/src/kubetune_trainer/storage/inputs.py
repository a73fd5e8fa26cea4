"""Models and data by URI: local paths as they are, s3:// prefixes mirrored to a local cache."""
from __future__ import annotations

import os
from pathlib import Path

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.uri import is_s3, parse_s3


def cache_root() -> Path:
    """Where s3:// inputs are mirrored; the operator points this at a volume of the pod."""
    return Path(os.environ.get("KUBETUNE_CACHE_DIR", Path.home() / ".cache" / "kubetune" / "inputs"))


def local_copy(uri: str) -> str:
    """A local path for a model or data URI; hub ids and local paths pass through unchanged.

    Files already mirrored with the same size are not fetched again, so every process on a node
    can call this after the first one has (see accelerator.local_main_process_first).
    """
    if not is_s3(uri):
        return uri
    location = parse_s3(uri)
    target = cache_root() / location.bucket / location.key
    s3.download_prefix(location, target)
    return str(target)
