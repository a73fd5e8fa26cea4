"""Models and data by URI: local paths as they are, s3:// prefixes mirrored to a local cache."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kubetune_api.contract import TrainerEnv

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.uri import is_s3, parse_s3


def cache_root() -> Path:
    """Where s3:// inputs are mirrored; the operator points this at a volume of the pod."""
    return Path(TrainerEnv.from_env(os.environ).cache_dir or Path.home() / ".cache" / "kubetune" / "inputs")


def mirrors_root() -> Path:
    """Where local_copy mirrors s3://BUCKET/KEY: MIRRORS/BUCKET/KEY (beside the data stream's tree,
    so no bucket name can land in it)."""
    return cache_root() / "s3"


def local_copy(uri: str) -> str:
    """A local path for a model or data URI; hub ids and local paths pass through unchanged.

    Files already mirrored with the object's size and time are not fetched again, so every process
    on a node can call this after the first one has (see accelerator.local_main_process_first).
    """
    if not is_s3(uri):
        return uri
    location = parse_s3(uri)
    target = mirrors_root() / location.bucket / location.key
    s3.download_prefix(location, target)
    return str(target)


def origin(path: str) -> str:
    """The s3:// URI that a local_copy path mirrors (any other path as it is): what names an input
    the same on every node, whatever directory each node's mirror lies in."""
    try:
        return "s3://" + Path(path).relative_to(mirrors_root()).as_posix()
    except ValueError:
        return path


def version_of(path: str) -> str | None:
    """A digest naming this version of a local input folder the same on every node: its origin and
    its files' names, sizes and times (a mirror's times are its objects', see s3.download_prefix).
    None for what is not a local folder (a hub id: the hub names its revisions)."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    files = sorted((p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in folder.rglob("*") if p.is_file())
    return hashlib.sha256(json.dumps([origin(path), files]).encode()).hexdigest()
