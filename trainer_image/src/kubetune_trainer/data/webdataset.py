"""spec.data.format webdataset: *.tar shards whose samples are the members sharing a key, read with
the standard library's tarfile.

WebDataset's convention: a member's key is its name up to the first dot of its base name, the rest
its extension (`0003.jpg`, `0003.txt`, `0003.json`, `0003.cls`). A sample takes its image from the
member with an image extension (a video layout's clip: .mp4, .webm or .mov; spec.data.imageColumn:
one extension only), its caption from
KEY.txt or from KEY.json's caption column, its label from KEY.cls or KEY.json's label column; an
edit pair its control images from KEY.control.png, or KEY.control_0.png, KEY.control_1.png, ...
(spec.data.controlColumn names the part before the image extension).

Indexing a shard reads its headers and its small text members; tarfile skips image data by
seeking, so a streamed shard is read by ranges (storage.members) and each image stays in the shard
until the loader or the prefetcher reads it: one ranged read of exactly its bytes.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

from kubetune_trainer.data.data_files import not_text
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.containers import read_containers
from kubetune_trainer.data.records import Columns, Stored
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.members import MEMBERS, Member, container_size, open_container, read_range

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
VIDEO_EXTENSIONS = ("mp4", "webm", "mov")  # a video layout's clip member (spec.data.imageColumn: one of them)
TEXT_EXTENSIONS = ("txt", "json", "cls")  # read while indexing: they are small
# Where a streamed shard's next header lies more than a block on (images of over 1 MiB), the index
# reads this much there rather than a MiB of image (storage.stream.ranged_file).
HEADER_PROBE = 64 * 1024


class TarRange:
    """A member's bytes: `size` bytes at `offset` of its shard."""

    def __init__(self, offset: int, size: int):
        self.offset, self.size = offset, size
        self.span = (offset, size)  # a clip member is probed by ranges of it (storage.members.open_ranged)

    def read(self, member: Member) -> bytes:
        return read_range(member.container, self.offset, self.size)

    def head(self, member: Member, count: int) -> bytes:
        """The member's first COUNT bytes (where an image keeps its size)."""
        return read_range(member.container, self.offset, min(count, self.size))


def read_webdataset(root: Path, screen: Screen, columns: Columns) -> list[Stored]:
    return read_containers(root, screen, ".tar", "*.tar shards (spec.data.format webdataset reads WebDataset "
                           "shards: KEY.jpg + KEY.txt members)", lambda shard: _index(shard, columns),
                           f"webdataset {columns!r}")


def _split(name: str) -> tuple[str, str]:
    """(key, extension) of a member name: the extension starts at the base name's first dot."""
    folder, _, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension.lower()


def _index(shard: Path, columns: Columns) -> list:
    """The shard's samples as Stored records, and (where, why) for each bad one."""
    size = container_size(shard)
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    texts: dict[tuple[str, str], bytes] = {}
    problems = []
    with open_container(shard, probe=HEADER_PROBE) as handle:
        try:
            with tarfile.open(fileobj=handle, mode="r:") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    key, extension = _split(info.name)
                    if info.offset_data + info.size > size:
                        problems.append((f"{shard} member {info.name}",
                                         f"is cut off after {max(0, size - info.offset_data)} of its {info.size} "
                                         "bytes (the shard is truncated); write or upload the shard again"))
                        samples.pop(key, None)
                        break
                    samples.setdefault(key, {})[extension] = info
                    if extension in TEXT_EXTENSIONS:
                        texts[key, extension] = tar.extractfile(info).read()
        except tarfile.ReadError as err:
            last = next(reversed(samples), None)
            if not samples and not problems:
                raise ConfigError(f"{shard}: not a readable tar shard ({err}); write it again (e.g. with "
                                  "tar or webdataset's ShardWriter) or remove it") from None
            if not problems:  # ended inside a header: the shard is truncated after the last whole member
                problems.append((f"{shard} after sample {last}", f"the shard ends mid-header ({err}): it is "
                                 "truncated; write or upload the shard again"))
    found = []
    for key, members in samples.items():
        where = f"{shard} sample {key}"
        wanted = (columns.image,) if columns.image else VIDEO_EXTENSIONS if columns.clips else IMAGE_EXTENSIONS
        image = next((members[e] for e in wanted if e in members), None)
        if image is None:
            found.append((where, f"has no {'clip' if columns.clips else 'image'} member {key}.{'/'.join(wanted)} "
                                 f"(members: {', '.join(sorted(members))})"))
            continue
        try:
            value = _caption(key, texts, columns) if columns.wanted == "caption" else _label(key, texts, columns)
        except ValueError as err:
            found.append((where, str(err)))
            continue
        controls = tuple(_member_path(shard, info) for info in _controls(members, columns.control)) \
            if columns.edits else ()
        found.append(Stored(_member_path(shard, image), where, controls=controls, **{columns.wanted: value}))
    return problems + found


def _member_path(shard: Path, info: tarfile.TarInfo) -> Path:
    member = Member(shard, f"member {info.name}", info.name, info.size, TarRange(info.offset_data, info.size))
    return MEMBERS.add(member, info.name)


def _controls(members: dict[str, tarfile.TarInfo], control: str) -> list[tarfile.TarInfo]:
    """An edit pair's control images: KEY.CONTROL.png, else KEY.CONTROL_0.png, KEY.CONTROL_1.png, ... in order."""
    numbered = []
    for extension, info in members.items():
        stem, _, suffix = extension.rpartition(".")
        if suffix not in IMAGE_EXTENSIONS:
            continue
        if stem == control:
            return [info]
        name, _, number = stem.rpartition("_")
        if name == control and number.isdigit():
            numbered.append((int(number), info))
    return [info for _, info in sorted(numbered)]


def _text(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not UTF-8 text (byte {err.start})") from None


def _json_field(key: str, texts: dict, column: str, kind: str):
    if (key, "json") not in texts:
        return None
    try:
        record = json.loads(_text(texts[key, "json"], f"{key}.json"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{key}.json is not JSON ({err})") from None
    if not isinstance(record, dict) or column not in record:
        keys = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
        raise ValueError(f"{key}.json has no {kind} field {column!r} (spec.data.{kind}Column; it has {keys})")
    if isinstance(record[column], str) and (problem := not_text(record[column], column)):
        raise ValueError(f"{key}.json: {problem}")
    return record[column]


def _caption(key: str, texts: dict, columns: Columns):
    if (key, "txt") in texts:
        return _text(texts[key, "txt"], f"{key}.txt")
    caption = _json_field(key, texts, columns.caption, "caption")
    if caption is None:
        raise ValueError(f"has no caption: add {key}.txt, or {key}.json with a {columns.caption!r} field")
    return caption


def _label(key: str, texts: dict, columns: Columns):
    if (key, "cls") in texts:
        text = _text(texts[key, "cls"], f"{key}.cls")
        return int(text) if text.isdigit() else text
    label = _json_field(key, texts, columns.label, "label")
    if label is None:
        raise ValueError(f"has no label: add {key}.cls, or {key}.json with a {columns.label!r} field")
    return label
