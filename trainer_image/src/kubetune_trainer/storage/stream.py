"""s3:// data sets read as training goes, instead of copied whole before the first step.

`open_stream` lays the data set's tree out on the node's disk from one listing: the small files
(metadata.jsonl, captions, JSON records) are fetched, and every image is an empty placeholder.
The layout readers and their checks then work unchanged (names, existence, confinement). An
image's bytes arrive when it is read (`read_bytes`), by whichever process reads it: DataLoader
workers included, since the files on disk are the only state the processes share. Video clips
are streamed as images are (an "image" below is either); before training a clip's header is read
by ranges (`open_ranged`, data.video.probe), not the clip.

Each rank's `Prefetcher` fetches the images of its own next steps ahead of the loader and turns
those of the steps it trained back into placeholders, so at most about `cacheSize` of a data
set is on the disk at once and a data set larger than the pod's disk trains. A resumed run plans
from its saved position, so the stream continues there. Eviction never breaks a read: a file is
swapped for a placeholder atomically, and a reader that finds one fetches the image again.

Every fetched file takes its object's LastModified as its time: reopened by a restarted container
of the pod, the tree keeps what is still current, drops what was replaced (same size or not) and
removes what the bucket no longer lists.
"""
from __future__ import annotations

import fcntl
import io
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Callable

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.confine import relative_parts
from kubetune_trainer.storage.uri import S3Location, parse_s3

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Video clips (the video-captions layout) stream as images do: placeholders, fetched ahead of their
# step; before training only their headers are read, by ranges (data.video.probe).
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv")
# Parquet files and tar shards hold the images of spec.data.format parquet / webdataset: they stay
# placeholders too, and their images are read out of them by ranges (storage.members).
CONTAINER_SUFFIXES = (".parquet", ".tar")
STREAMED_SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES + CONTAINER_SUFFIXES
# A streamed container's members are copied into CONTAINER.members/ beside it (storage.members).
MEMBERS_SUFFIX = ".members"
FETCH_THREADS = 8
# The small files are fetched before the first step, a request each: a set whose captions are NAME.txt
# files has as many as images, and each waits a round trip: as many at once as the client has connections.
SMALL_FILE_THREADS = s3.POOL_CONNECTIONS


@dataclass
class Stream:
    """One streamed data set: where it is in S3, where its tree is on this node, each image's size."""

    location: S3Location
    root: Path
    images: dict[str, s3.StoredObject] = field(default_factory=dict)  # image key under the prefix -> size, time
    fetched_images: int = 0                                # by this process (its threads included)
    fetched_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _fetching: dict[str, threading.Lock] = field(default_factory=dict, repr=False)

    def image_key(self, path: Path) -> str | None:
        """PATH's key under the prefix when it is one of the streamed images, else None."""
        try:
            key = PurePosixPath(path.relative_to(self.root)).as_posix()
        except ValueError:
            return None
        return key if key in self.images else None

    def fill(self, path: Path, key: str) -> int:
        """Fetch the image unless it is on disk already; the bytes fetched. One fetch per image at a
        time in this process: the prefetcher and the loader asking together share it."""
        size = self.images[key].size
        if size == 0 or _size(path) == size:
            return 0
        with self._lock:
            single_flight = self._fetching.setdefault(key, threading.Lock())
        with single_flight:
            if _size(path) == size:
                return 0
            body = s3.client().get_object(Bucket=self.location.bucket, Key=self.location.prefix + key)["Body"].read()
            _replace(path, body, self.images[key].modified_ns)
        with self._lock:
            self.fetched_images += 1
            self.fetched_bytes += len(body)
        return len(body)

    def empty(self, path: Path) -> int:
        """Turn the image back into a placeholder; the bytes freed."""
        size = _size(path)
        if size:
            _replace(path, b"")
        return size

    def read(self, path: Path, key: str) -> bytes:
        """The image's bytes, fetched first when it is a placeholder. A file emptied between the
        check and the read (eviction) is fetched again."""
        for _ in range(3):
            self.fill(path, key)
            data = Path(path).read_bytes()
            if len(data) == self.images[key].size:
                return data
        raise OSError(f"{path}: {self.location.uri}/{key} did not arrive whole (is it being rewritten?)")

    def read_range(self, key: str, start: int, size: int) -> bytes:
        """SIZE bytes of the object KEY from START, without fetching the rest (nor writing it)."""
        if size == 0:
            return b""
        return s3.client().get_object(Bucket=self.location.bucket, Key=self.location.prefix + key,
                                      Range=f"bytes={start}-{start + size - 1}")["Body"].read()

    def listed_size(self, key: str) -> int:
        return self.images[key].size

    def remote(self, path: Path, key: str) -> bool:
        """Whether reading the object costs a fetch (it is not on disk whole)."""
        return _size(path) != self.images[key].size

    def open_ranged(self, path: Path, key: str) -> BinaryIO:
        """The object as a seekable file that fetches only the ranges read (a clip's header)."""
        return ranged_file(lambda start, size: self.read_range(key, start, size), self.images[key].size)

    def image_size(self, path: Path, key: str) -> tuple[int, int]:
        """(width, height) from the image's header: of an image not on disk yet, only its first
        HEADER_BYTES are fetched (aspect-ratio bucketing reads every size before training)."""
        size = self.images[key].size
        on_disk = _size(path) == size
        head = None if on_disk else (lambda: self.read_range(key, 0, min(HEADER_BYTES, size)))
        return size_from_header(head, lambda: self.read(path, key))

    def describe(self, path: Path) -> str:
        return str(path)


# Streamed trees on this node by local root (forked DataLoader workers inherit it).
_STREAMS: dict[Path, Stream] = {}
# Other sources of image paths with Stream's reading and prefetching methods (storage.members:
# images inside parquet files and tar shards). Consulted after the streamed trees.
_SOURCES: list = []


def register_source(source) -> None:
    if source not in _SOURCES:
        _SOURCES.append(source)


def _fresh_locks_in_child() -> None:
    """A forked DataLoader worker gets new locks: one a prefetch thread held at the fork would
    otherwise stay held in the child forever."""
    for stream in _STREAMS.values():
        stream._lock, stream._fetching = threading.Lock(), {}


os.register_at_fork(after_in_child=_fresh_locks_in_child)


def stream_root() -> Path:
    from kubetune_trainer.storage.inputs import cache_root

    return cache_root() / "stream"


def open_stream(uri: str) -> str:
    """Lay out the tree of the s3:// data set URI on this node; its local root. Safe to call from
    every process of a node: one lays the tree out while the others wait, and what is already there
    and current is kept."""
    location = parse_s3(uri)
    root = stream_root() / location.bucket / location.key
    objects = s3.list_stored_objects(location)
    if not objects:
        raise FileNotFoundError(f"{uri} is empty or does not exist")
    stream = Stream(location, root)
    root.parent.mkdir(parents=True, exist_ok=True)
    # The node's first process lays the tree out; the others wait, then find it done (else each of a
    # node's 8 processes fetched every caption file).
    with node_lock(root.with_name(f".{root.name}.lock")):
        small, folders = [], set()
        for key, stored in objects.items():
            if key.endswith("/"):
                continue
            # Keys are chosen by whoever writes the bucket: each must stay under root. The tree is this
            # process's own making (no symlinks in it), so checking the text suffices, and is quick.
            path = root.joinpath(*relative_parts(root, key, f"object key under {uri}"))
            if PurePosixPath(key).suffix.lower() in STREAMED_SUFFIXES:
                stream.images[key] = stored
                if path.parent not in folders:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    folders.add(path.parent)
            elif not s3.mirrors(path, stored):  # a caption fixed in place keeps its size, not its time
                small.append(key)
        # Creating files is slow on some disks (a millisecond each): in parallel, with the small files.
        with ThreadPoolExecutor(SMALL_FILE_THREADS) as pool:
            list(pool.map(lambda key: _placeholder(root / key, stream.images[key]), stream.images))
            list(pool.map(lambda key: s3.download_file(location.child(key), root / key, objects[key].modified_ns,
                                                       objects[key].size), small))
        removed = _remove_unlisted(root, objects)
    _STREAMS[root] = stream
    log.info("streaming %s: %d images listed (%.1f MB), %d small files fetched%s", uri, len(stream.images),
             sum(image.size for image in stream.images.values()) / 1e6, len(small),
             f", {removed} files no longer in the bucket removed" if removed else "")
    return str(root)


def _remove_unlisted(root: Path, listed: dict[str, s3.StoredObject]) -> int:
    """Remove the files of an earlier container's tree whose objects are gone from the bucket: the
    layouts that walk a folder (caption files NAME.txt, image-folder) would train on them. Hidden
    files (_replace's partial writes), s3.download_file's NAME.part and the members copied out of
    containers (CONTAINER.members/, which another process of the node may be filling now) are not
    objects of the listing, and are left alone."""
    removed = 0
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if not name.endswith(MEMBERS_SUFFIX)]
        for name in files:
            path = Path(folder, name)
            if not name.startswith(".") and not name.endswith(".part") and \
                    path.relative_to(root).as_posix() not in listed:
                path.unlink(missing_ok=True)
                removed += 1
    return removed


@contextmanager
def node_lock(path: Path):
    """Held by one process of the node at a time: fcntl.flock on PATH (never through a link),
    released when the holder closes it or dies."""
    lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)


def streamed(root: Path) -> Stream | None:
    return _STREAMS.get(Path(root))


def streamed_object(path: Path) -> tuple[Stream, str] | None:
    """(its stream, its key) when PATH is the placeholder of a streamed object, else None."""
    for stream in _STREAMS.values():
        key = stream.image_key(Path(path))
        if key is not None:
            return stream, key
    return None


def _stream_of(path: Path) -> tuple[Stream, str] | None:
    for stream in (*_STREAMS.values(), *_SOURCES):
        key = stream.image_key(path)
        if key is not None:
            return stream, key
    return None


def read_bytes(path: Path) -> bytes:
    """An image's bytes: from the disk, or from S3 first when it is a streamed placeholder (or from
    its container, storage.members)."""
    found = _stream_of(Path(path))
    if found is None:
        return regular_file(Path(path)).read_bytes()
    return found[0].read(Path(path), found[1])


def in_place(path: Path) -> bool:
    """Whether PATH's bytes are the file at PATH (not a streamed placeholder's, nor a container member's)."""
    return _stream_of(Path(path)) is None


class NotARegularFile(OSError):
    """A data-set path that is a FIFO, a socket or a device: reading it would block or never end."""


def regular_file(path: Path) -> Path:
    """PATH, unless it is not a regular file: opening a FIFO among the images blocks the loader
    for ever (and a device never ends), so such a path is refused naming what it is."""
    import stat

    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        raise NotARegularFile(f"is {kind}, not a regular file: only regular files are read from a data set")
    return path


def open_image(path: Path):
    """PATH as a PIL image (its header read, its pixels not decoded yet), its bytes fetched first
    when it is a streamed placeholder. Only a regular file is opened (see regular_file)."""
    from PIL import Image

    if _stream_of(Path(path)) is None:
        return Image.open(regular_file(path))
    return Image.open(io.BytesIO(read_bytes(path)))


def remote(path: Path) -> bool:
    """Whether PATH's bytes are not on this node yet: a streamed object (or a streamed container's
    member) with no copy on disk. Reading all of it would fetch it whole."""
    found = _stream_of(Path(path))
    return found is not None and found[0].remote(Path(path), found[1])


def open_ranged(path: Path) -> BinaryIO:
    """A remote (see `remote`) object as a seekable binary file that fetches the ranges read
    (ranged_file): readers that seek (a video's demuxer) take only the parts they need."""
    found = _stream_of(Path(path))
    return found[0].open_ranged(Path(path), found[1])


# How a streamed object is read by ranges (_RangedObject): a gap under READ_BLOCK is read through
# and a read over it is one exact GET; GETs of a reader going on in order grow up to READ_AHEAD_MAX;
# a read far from the last one fetches a block around it (a probe, where the caller gives one).
READ_BLOCK = 1024 * 1024
READ_AHEAD_MAX = 8 * 1024 * 1024


def ranged_file(read_range: Callable[[int, int], bytes], size: int, block: int = READ_BLOCK,
                probe: int | None = None) -> BinaryIO:
    """A seekable binary file of SIZE bytes whose reads are read_range(start, count) calls, fetched
    in spans that grow while the reader goes on in order (see _RangedObject)."""
    return _RangedObject(read_range, size, block, probe or block)


class _RangedObject(io.RawIOBase):
    """Small reads are served from the spans fetched around them, the last few kept: a reader that
    seeks back and forth (a demuxer reading an .mp4's header at its end, then its first frame)
    fetches each span once. A read of more than BLOCK bytes that no kept span holds is one ranged
    read of exactly its bytes (a parquet column chunk).

    A read that lands after the latest span, less than BLOCK beyond it, continues from that span's
    end with twice its length (up to READ_AHEAD_MAX): reading through a gap of less than a block
    costs less than another GET (per GET the client spends more CPU than on a MiB of body, and
    across a network a round trip carries MBs). A read anywhere else fetches `probe` bytes around it:
    a block by default, so a clip's header and first frame come in one GET (a small clip whole);
    a shard's index probes 64 KiB (data.webdataset). So tarfile indexing a shard of 60 KB images
    makes a few GETs of up to 8 MiB (the index of 20,000 took 7.8 s in 1 MiB GETs, 5.5 s so:
    benchmarks/RESULTS.md), and a shard of images of several MB, whose headers lie far apart,
    costs one probe per member instead of a MiB of image each."""

    SPANS_KEPT = 4

    def __init__(self, read_range: Callable[[int, int], bytes], size: int, block: int, probe: int):
        self.read_range, self.size, self.position, self.block, self.probe = read_range, size, 0, block, probe
        self._spans: OrderedDict[int, bytes] = OrderedDict()  # start -> bytes, the latest used last
        self._end, self._length = None, 0  # the latest fetched span's end and length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def _kept(self, position: int) -> tuple[int, bytes] | None:
        for start, data in self._spans.items():
            if start <= position < start + len(data):
                self._spans.move_to_end(start)
                return start, data
        return None

    def _fetch(self, position: int) -> tuple[int, bytes]:
        if self._end is not None and 0 <= position - self._end < self.block:  # on in order: read through
            start = self._end
            length = max(min(2 * self._length, READ_AHEAD_MAX), position - start + self.probe)
        else:
            start, length = position - position % self.probe, self.probe
        data = self.read_range(start, min(length, self.size - start))
        self._end, self._length = start + len(data), length
        self._spans[start] = data
        while len(self._spans) > self.SPANS_KEPT or (len(self._spans) > 1 and
                                                     sum(map(len, self._spans.values())) > 2 * READ_AHEAD_MAX):
            self._spans.popitem(last=False)  # at most two full spans: 8 index threads hold 128 MiB at most
        return start, data

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self.size - self.position))
        kept = self._kept(self.position) if count else None
        if count > self.block and (kept is None or kept[0] + len(kept[1]) < self.position + count):
            data = self.read_range(self.position, count)
            buffer[:len(data)] = data
            self.position += len(data)
            return len(data)
        done = 0
        while done < count:
            start, data = self._kept(self.position) or self._fetch(self.position)
            piece = data[self.position - start:self.position - start + count - done]
            if not piece:
                break
            buffer[done:done + len(piece)] = piece
            done += len(piece)
            self.position += len(piece)
        return done


def describe(path: Path) -> str:
    """How messages name an image: its path, or its container and place in it (storage.members)."""
    found = _stream_of(Path(path))
    return str(path) if found is None else found[0].describe(Path(path))


HEADER_BYTES = 64 * 1024  # where PNG, JPEG and WebP keep their size (bar huge metadata blocks)


def size_from_header(head, whole) -> tuple[int, int]:
    """An image's (width, height) from head() (its first bytes: most formats keep the size there),
    else, with no head or a size further in, from whole() (all its bytes)."""
    from PIL import Image

    from kubetune_trainer.data.image_input import oriented_size

    if head is not None:
        try:
            with Image.open(io.BytesIO(head())) as image:
                return oriented_size(image)
        except (OSError, SyntaxError, ValueError):
            pass  # the size is further in: read the whole image
    with Image.open(io.BytesIO(whole())) as image:
        return oriented_size(image)


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) of an image, of a streamed one from as few bytes as its source allows."""
    from kubetune_trainer.data.image_input import oriented_size

    found = _stream_of(Path(path))
    if found is not None:
        return found[0].image_size(Path(path), found[1])
    with open_image(path) as image:
        return oriented_size(image)


class Prefetcher:
    """Keeps this rank's next steps' images on disk, and no more than `budget` bytes of them.

    `plan(steps)`: the images of each step this rank will train, in order (an epoch from the
    current position). `advance()`: one step trained; its images become placeholders again.

    A member whose read brings others along (a parquet row: its row group's column, 100 rows read to
    train one) leaves copies of those this rank trains later in the plan ("kept", within the budget
    left), so that each row group is read about once an epoch per rank instead of once per row
    (benchmarks/data_streaming.py: parquet at 0.87-0.93 of local files before). A kept image's bytes
    count as kept until its step's fetch starts, then as that step's.

    The steps of the window are fetched side by side (their images share `threads` fetches), not
    one after another: with one image a step (batch 1, what large models train) and 40 ms a request
    a step-by-step pump fetched one image at a time, 22 images/s (benchmarks/data_streaming.py).

    `first_step_alone` (what a training run asks): until the first step is trained only that step
    is fetched, since its images are what the first step waits for, not the next `ahead_steps`
    alongside (parquet row groups: 8 steps of 8 x 6 MB). Measured on a loaded 2-core machine
    (benchmarks/data_formats.py, RESULTS.md): index end to first batch 4.1 s with the window open,
    2.7-4.4 s with this, 2.2 s with --prefetch-steps 1 -- within that machine's noise so far. The
    first step is now loaded in the training process (loop.iterate_steps), whose reads wait for
    these fetches and take their copies: 0.6 s from the index to the first batch (RESULTS.md).
    """

    def __init__(self, budget: int, ahead_steps: int, threads: int = FETCH_THREADS, first_step_alone: bool = False):
        self.budget, self.ahead_steps = budget, ahead_steps
        self.steps: list[list[Path]] = []
        self.trained = 0          # steps of the plan trained
        self.fetched = 0          # steps of the plan whose images are on disk (all steps before it too)
        self.started_fetch = 0    # steps of the plan whose fetch has started (fetched <= started_fetch)
        self.on_disk = 0          # bytes of the fetched steps' images not yet trained
        self.in_flight = 0        # bytes of the steps being fetched
        self.peak = 0             # the most bytes of planned images on disk at once
        self.kept: dict[Path, int] = {}  # images of later steps copied along with an earlier one: their bytes
        self.kept_bytes = 0
        self.kept_images = 0  # over the run: images copied along with another's read (the end-of-run line)
        self._step_of: dict[Path, int] = {}  # each planned image -> the last step of the plan that trains it
        self.started = not first_step_alone  # whether the window is open (from the first step trained)
        self._arrived: set[int] = set()  # steps fetched after a step before them still in flight
        self._pool = ThreadPoolExecutor(threads)
        # A step in flight waits for its images' fetches: more steps in flight than fetch threads add nothing.
        self._steps_pool = ThreadPoolExecutor(max(min(ahead_steps, threads), 1))
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name="data-prefetch", daemon=True)
        self._thread.start()

    def plan(self, steps: list[list[Path]]) -> None:
        with self._changed:
            self.steps = [list(s) for s in steps]
            self.trained = self.fetched = self.started_fetch = self.on_disk = self.in_flight = 0
            self._arrived.clear()
            self._step_of = {path: number for number, step in enumerate(self.steps) for path in step}
            left, self.kept, self.kept_bytes = list(self.kept), {}, 0
            self._changed.notify_all()
        for path in left:  # kept for the old plan's steps (a plan cut short): not counted any more
            _empty(path)

    def advance(self) -> None:
        with self._changed:
            done = self.steps[self.trained] if self.trained < len(self.steps) else []
            self.trained += 1
            self.started = True
            self.fetched = max(self.fetched, self.trained)
            self.started_fetch = max(self.started_fetch, self.trained)
            # Kept for this step, which trained before its fetch started (the loader read them).
            kept = sum(self._unkeep(path) for path in done)
        freed = sum(_empty(path) for path in done)  # here, not behind the pool's fetches: it is quick
        with self._changed:
            self.on_disk = max(0, self.on_disk - max(0, freed - kept))
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        self._steps_pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _next_step(self) -> tuple[list[Path], int] | None:
        """The images of the next step to fetch and their bytes, when the window and the budget allow one."""
        ahead = self.ahead_steps if self.started else 1
        upcoming_step = self.started_fetch
        if upcoming_step >= len(self.steps) or upcoming_step >= self.trained + ahead:
            return None
        upcoming = self.steps[upcoming_step]
        size = sum(_listed_size(p) for p in upcoming)
        kept = sum(self.kept.get(p, 0) for p in upcoming)  # already on disk, counted as kept
        if upcoming_step > self.trained and self.on_disk + self.in_flight + self.kept_bytes - kept + size > self.budget:
            return None  # always one step ahead, more only within the budget
        return upcoming, size

    def _unkeep(self, path: Path) -> int:
        """PATH's bytes leave the kept ledger (its step's fetch or training took it over). Under _changed."""
        size = self.kept.pop(path, 0)
        self.kept_bytes -= size
        return size

    def _pump(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or self._next_step() is not None)
                if self._closed:
                    return
                (upcoming, size), plan, number = self._next_step(), self.steps, self.started_fetch
                self.started_fetch += 1
                self.in_flight += size
                for path in upcoming:
                    self._unkeep(path)
            self._steps_pool.submit(self._fetch_step, plan, number, upcoming, size)

    def _fetch_step(self, plan: list[list[Path]], number: int, images: list[Path], reserved: int) -> None:
        size = reserved
        try:
            list(self._pool.map(lambda path: self._fill_keeping(plan, path), images))
        except Exception as err:  # noqa: BLE001 -- the loader fetches what is missing itself, and says why it cannot
            log.debug("prefetching step %d: %s", number, err)
            size = sum(_size(path) or 0 for path in images)  # what did arrive
        with self._changed:
            if self.steps is not plan:
                return  # re-planned meanwhile: the new plan's steps are counted afresh
            self.in_flight -= reserved
            trained_meanwhile = number < self.trained
            if not trained_meanwhile:
                self.on_disk += size
                self._arrived.add(number)
                while self.fetched in self._arrived:
                    self._arrived.discard(self.fetched)
                    self.fetched += 1
                self.peak = max(self.peak, self.on_disk + self.kept_bytes)
            self._changed.notify_all()
        if trained_meanwhile:  # its step went by while it was fetched: no one reads these copies
            for path in images:
                _empty(path)

    def _fill_keeping(self, plan: list[list[Path]], path: Path) -> None:
        """Fetch PATH, and keep the companions its read brings along that a later step trains, as far
        as the budget goes."""
        _fill(path)
        found = _stream_of(path)
        companions = getattr(found[0], "companions", None) if found else None
        if companions is None:
            return
        with self._changed:
            if self.steps is not plan or not self.started:
                return  # (until the first step is trained, its own images are all it waits for)
            # The window's steps not started yet come first: kept images never hold back its fetches.
            room = self.budget - self.on_disk - self.in_flight - self.kept_bytes - self._window_left()
            wanted = []
            for other in companions(path, found[1]):
                size = _listed_size(other)
                if self._step_of.get(other, -1) >= self.started_fetch and other not in self.kept and size <= room:
                    self.kept[other] = size
                    self.kept_bytes += size
                    room -= size
                    wanted.append(other)
        if not wanted:
            return
        try:
            found[0].fill_all(wanted)
            with self._changed:
                self.kept_images += len(wanted)
                replanned = self.steps is not plan
            if replanned:  # plan() emptied what it found kept: these arrived after
                for other in wanted:
                    _empty(other)
        except Exception as err:  # noqa: BLE001 -- only a head start: each is fetched again in its own step
            log.debug("keeping %d images read along with %s: %s", len(wanted), path, err)
            with self._changed:
                still_kept = [other for other in wanted if self.steps is plan and self._unkeep(other)]
            for other in still_kept:  # the others' steps took them over meanwhile: theirs to fetch
                _empty(other)

    def _window_left(self) -> int:
        """Bytes the window's steps not started yet will fetch (those not kept already). Under _changed."""
        ahead = self.ahead_steps if self.started else 1
        end = min(len(self.steps), self.trained + ahead)
        return sum(_listed_size(p) for step in self.steps[self.started_fetch:end] for p in step if p not in self.kept)


def _fill(path: Path) -> int:
    found = _stream_of(path)
    return found[0].fill(path, found[1]) if found else 0


def _empty(path: Path) -> int:
    found = _stream_of(path)
    return found[0].empty(path) if found else 0


def _listed_size(path: Path) -> int:
    found = _stream_of(path)
    return found[0].listed_size(found[1]) if found else 0


def _placeholder(path: Path, stored: s3.StoredObject) -> None:
    """An empty file where the image goes, unless the image is there already (fetched by an earlier
    container of this pod, and still the object's size and time)."""
    present = _size(path)
    if present is None:
        path.touch()
    elif present and not s3.mirrors(path, stored):  # an older version of the object
        _replace(path, b"")


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _replace(path: Path, data: bytes, modified_ns: int | None = None) -> None:
    """Write DATA as PATH atomically (with MODIFIED_NS as its time): a reader sees the old file or
    the new one, never a part."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    partial.write_bytes(data)
    if modified_ns is not None:
        os.utime(partial, ns=(modified_ns, modified_ns))
    os.replace(partial, path)
