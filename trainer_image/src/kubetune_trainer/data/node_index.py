"""A streamed parquet file's or shard's index, made once per node.

Indexing a streamed container reads it by ranges (a shard: every header, so about all of a shard
of small images). Every process of a node reads the same samples: without this, a node of 8
processes read the data set 8 times before its first step. The first process of the node to index
a container writes what it found (the records, and the members they name: storage.members) under
the node's cache; the node's other processes wait for it (a lock per container) and read that
instead, as does a container restarted in the same pod (the operator's cache is the pod's emptyDir;
a re-created pod starts empty) or the next `kubetune train` on a workstation, while the object is
unchanged (same key, size, time and ETag as listed: a shard whose caption was fixed keeps its
size, tar pads members, and an upload in the same second its time).

Local containers are indexed in place every time: reading a local file is cheap, and nothing is
written beside a user's data.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
from pathlib import Path
from typing import Callable

from kubetune_trainer.data.records import Stored
from kubetune_trainer.storage import stream
from kubetune_trainer.storage.inputs import cache_root
from kubetune_trainer.storage.members import MEMBERS

log = logging.getLogger(__name__)

VERSION = 1  # of what an index file holds: a change of the records or members makes older files unread


def indexed(container: Path, reading: str, index: Callable[[Path], list]) -> list:
    """index(CONTAINER): the records and problems it finds. READING names what index reads (the
    format and columns): an index made for other columns is not this one."""
    found = stream.streamed_object(container)
    if found is None:
        return index(container)
    source, key = found
    listed = source.images[key]
    identity = repr((VERSION, reading, str(container), listed.size, listed.modified_ns, listed.etag))
    file = cache_root() / "indexes" / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.pickle"
    file.parent.mkdir(parents=True, exist_ok=True)
    with stream.node_lock(file.with_suffix(".lock")):  # the node's other processes wait here
        kept = _read(file, identity)
        if kept is not None:
            records, members = kept
            for path, member in members:
                MEMBERS.register(path, member)
            return records
        records = index(container)
        stream._replace(file, pickle.dumps((identity, records, _members_of(records)), pickle.HIGHEST_PROTOCOL))
        return records


def _members_of(records: list) -> list:
    """(path, Member) of every member the records name (their images and control images): what a
    process that reads the index must register to read them."""
    paths = [path for record in records if isinstance(record, Stored) for path in (record.image, *record.controls)]
    return [(path, member) for path in paths if (member := MEMBERS.member(path)) is not None]


def _read(file: Path, identity: str) -> tuple[list, list] | None:
    """The index in FILE if it is this container's (a missing, foreign or unreadable file: None)."""
    try:
        with open(file, "rb") as handle:
            kept_identity, records, members = pickle.load(handle)  # written by this node's processes only
    except FileNotFoundError:
        return None
    except Exception as err:  # a file from another version, or damaged: index again and replace it
        log.warning("index %s unreadable (%s); indexing again", file, err)
        return None
    return (records, members) if kept_identity == identity else None
