"""Images stored inside other files (a parquet file's rows, a WebDataset shard's members), given
paths of their own, so that samples, screening, the loader and the prefetcher handle them as they
handle loose images (storage.stream reads them through MEMBERS).

A member's path is <container>.members/<name>, beside its container: it names the image to the
sampler and the prefetcher, and it is where a prefetched copy lies. Its bytes come from the
container: a local file read where they lie, or an s3:// object that storage.stream keeps as an
empty placeholder and that is read by ranges, never fetched whole. So a streamed data set in
shards is fetched image by image, as loose files are: the prefetcher fills a member's path ahead
of its step (loader workers, other processes, find the copy there) and empties it after; a reader
that finds no copy reads the container itself.
"""
from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from kubetune_trainer.storage import stream
from kubetune_trainer.storage.confine import confined


class Locator(Protocol):
    """Where an image is inside its container. A locator whose read brings others' bytes along (a
    parquet row: its row group's column) also has `read_with` (one key per such read) and
    `read_all(members) -> [bytes]` (those members from one read), so that the prefetcher can keep
    them instead of reading the same group again for each (MemberSet.companions)."""

    def read(self, member: "Member") -> bytes: ...


@dataclass(frozen=True)
class Member:
    container: Path   # the local file, or the placeholder of a streamed object
    place: str        # how messages name it in the container: "row 3", "member 0003.jpg"
    name: str         # the sample's own name (what the held-out split hashes)
    size: int         # bytes, for the prefetcher's budget (a parquet row: its row group's share)
    locator: Locator


def member_path(container: Path, name: str) -> Path:
    """Where the member NAME of CONTAINER is addressed (NAME from the container: confined)."""
    return confined(container.with_name(container.name + stream.MEMBERS_SUFFIX), name, f"name in {container}")


def container_size(container: Path) -> int:
    found = stream.streamed_object(container)
    return found[0].images[found[1]].size if found else container.stat().st_size


def read_range(container: Path, start: int, size: int) -> bytes:
    """SIZE bytes of CONTAINER from START: a local read, or one ranged GET of a streamed object."""
    found = stream.streamed_object(container)
    if found is not None:
        data = found[0].read_range(found[1], start, size)
        with MEMBERS._lock:
            MEMBERS.ranged_bytes += len(data)
        return data
    with open(container, "rb") as file:
        return os.pread(file.fileno(), size, start)


def open_container(container: Path, block: int = stream.READ_BLOCK, probe: int | None = None) -> BinaryIO:
    """CONTAINER as a seekable binary file (tarfile and pyarrow read it): a streamed object reads
    the ranges asked for (stream.ranged_file: BLOCK, PROBE) instead of the whole object."""
    found = stream.streamed_object(container)
    if found is None:
        return open(container, "rb")
    return stream.ranged_file(lambda start, size: read_range(container, start, size), container_size(container),
                              block, probe)


class MemberSet:
    """Every member image this process has read an index of, by path (forked loader workers
    inherit it). Has storage.stream.Stream's reading and prefetching methods."""

    def __init__(self):
        self.members: dict[str, Member] = {}
        self.fetched_images = 0
        self.fetched_bytes = 0
        self.ranged_bytes = 0  # read out of streamed containers by this process (a parquet row: its row group)
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}  # members being filled in this process: their fill's lock
        self._read_together: dict[tuple, list[Path]] = {}  # (container, locator's read_with) -> its members

    def add(self, member: Member, name: str) -> Path:
        """Register MEMBER under NAME (unique in its container); its path."""
        path = member_path(member.container, name)
        self.register(path, member)
        return path

    def register(self, path: Path, member: Member) -> None:
        """MEMBER at PATH, as `add` placed it (data.node_index: registered again from the node's index)."""
        self.members[str(path)] = member
        read_with = getattr(member.locator, "read_with", None)
        if read_with is not None:
            self._read_together.setdefault((member.container, read_with), []).append(path)

    def member(self, path: Path) -> Member | None:
        return self.members.get(str(path))

    # --- what storage.stream asks of an image source -------------------------------------------

    def image_key(self, path: Path) -> str | None:
        key = str(path)
        return key if key in self.members else None

    def fill(self, path: Path, key: str) -> int:
        """A copy of a streamed container's member at PATH (a local container is read in place)."""
        member = self.members[key]
        if stream.streamed_object(member.container) is None or _has_copy(path):
            return 0
        with self._lock:
            filling = self._fetching.setdefault(key, threading.Lock())
        with filling:  # one fill of a member at a time; a reader meanwhile waits for its copy (read)
            try:
                if _has_copy(path):  # filled while this thread waited
                    return 0
                data = member.locator.read(member)
                path.parent.mkdir(parents=True, exist_ok=True)
                stream._replace(path, data)
            finally:
                with self._lock:
                    if self._fetching.get(key) is filling:
                        del self._fetching[key]
        with self._lock:
            self.fetched_images += 1
            self.fetched_bytes += len(data)
        return len(data)

    def companions(self, path: Path, key: str) -> list[Path]:
        """The other members whose bytes reading PATH's member brings along (its parquet row group)."""
        member = self.members[key]
        read_with = getattr(member.locator, "read_with", None)
        if read_with is None or stream.streamed_object(member.container) is None:
            return []
        return [other for other in self._read_together.get((member.container, read_with), ()) if other != path]

    def fill_all(self, paths: list[Path]) -> int:
        """Copies of PATHS, companions of one member (`companions`), from one read of their container;
        the bytes written. A path being filled or already copied is left to that."""
        with self._lock:
            wanted = [p for p in paths if str(p) not in self._fetching and not _has_copy(p)]
        if not wanted:
            return 0
        members = [self.members[str(p)] for p in wanted]
        written = 0
        for path, data in zip(wanted, members[0].locator.read_all(members)):
            path.parent.mkdir(parents=True, exist_ok=True)
            stream._replace(path, data)
            written += len(data)
        with self._lock:
            self.fetched_images += len(wanted)
            self.fetched_bytes += written
        return written

    def empty(self, path: Path) -> int:
        size = stream._size(path) or 0
        if size:
            stream._replace(path, b"")
        return size

    def read(self, path: Path, key: str) -> bytes:
        """The member's bytes: its copy, else from its container. A streamed member the prefetcher is
        fetching in this process is waited for (the first step, loaded here while the prefetcher
        fetches it, reads each row group or range once), then read from the copy it wrote."""
        member = self.members[key]
        with self._lock:
            filling = self._fetching.get(key)
        if filling is not None:
            with filling:
                pass  # the fill in flight has finished: its copy is there (or, if it failed, none)
        if _has_copy(path):
            data = path.read_bytes()
            if data:  # copies are written whole (a rename): empty means evicted meanwhile
                return data
        return member.locator.read(member)

    def listed_size(self, key: str) -> int:
        return self.members[key].size

    def remote(self, path: Path, key: str) -> bool:
        return stream.streamed_object(self.members[key].container) is not None and not _has_copy(path)

    def open_ranged(self, path: Path, key: str) -> BinaryIO:
        """The member as a seekable file: read by ranges where its container can (a shard member),
        else read whole into memory (a parquet row: its row group's column is read anyway)."""
        member = self.members[key]
        span = getattr(member.locator, "span", None)  # (offset, size) where the member lies whole in its container
        if span is None:
            return io.BytesIO(member.locator.read(member))
        offset, size = span
        return stream.ranged_file(lambda start, count: read_range(member.container, offset + start, count), size)

    def image_size(self, path: Path, key: str) -> tuple[int, int]:
        """(width, height) from the image's first bytes where its container can read a part of it
        (a shard member: aspect-ratio bucketing reads every size before training), else from all."""
        member = self.members[key]
        head = getattr(member.locator, "head", None)
        first_bytes = (lambda: head(member, stream.HEADER_BYTES)) if head is not None and not _has_copy(path) else None
        return stream.size_from_header(first_bytes, lambda: self.read(path, key))

    def describe(self, path: Path) -> str:
        member = self.members[str(path)]
        return f"{member.container} {member.place}"


def _has_copy(path: Path) -> bool:
    return bool(stream._size(path))


MEMBERS = MemberSet()
stream.register_source(MEMBERS)


class SmallCache:
    """The last few values computed per key, per process (a parquet row group's image column:
    consecutive rows of one group are read once)."""

    def __init__(self, entries: int):
        self.entries, self._values, self._lock = entries, OrderedDict(), threading.Lock()
        self._computing: dict = {}  # per key being computed: its lock (two threads asking compute it once)
        os.register_at_fork(after_in_child=self._fresh_lock)

    def _fresh_lock(self) -> None:
        self._lock, self._computing = threading.Lock(), {}  # one a thread held at the fork would stay held

    def get(self, key, compute):
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            computing = self._computing.setdefault(key, threading.Lock())
        with computing:  # the prefetcher's threads (two rows of one row group) and the loader alike
            with self._lock:
                if key in self._values:  # computed while this thread waited
                    self._values.move_to_end(key)
                    return self._values[key]
            try:
                value = compute()
            except BaseException:
                with self._lock:
                    self._computing.pop(key, None)
                raise
            with self._lock:
                self._values[key] = value
                while len(self._values) > self.entries:
                    self._values.popitem(last=False)
                self._computing.pop(key, None)
        return value


def _fresh_lock_in_child() -> None:
    MEMBERS._lock, MEMBERS._fetching = threading.Lock(), {}


os.register_at_fork(after_in_child=_fresh_lock_in_child)
