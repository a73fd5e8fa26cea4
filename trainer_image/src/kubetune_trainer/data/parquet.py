"""spec.data.format parquet: *.parquet files as Hugging Face `datasets` saves them, read with pyarrow.

The image column holds, per row, a {"bytes", "path"} struct (datasets' Image feature: the bytes,
or only a path when they were not embedded), the bytes themselves, or a path; paths are relative
to spec.data.uri. Bytes stay in the file: a row is a member image (storage.members) read from its
row group when the loader or the prefetcher reaches it, so indexing a file reads its footer and
its caption or label column only. A label column holds class indices (datasets' ClassLabel, whose
names the imagefolder builder sorts, numbering classes as class folders are) or class names.

An edit pair's control column holds one image per row in those forms, or a list of them (datasets'
`Sequence(Image())`: qwen-image-edit-plus and flux2 take several references): item i of a row's
list is its control image i, named "FILE row N column COLUMN[i]". A list of structs is indexed from
its paths only; a list of plain bytes is read whole while indexing (its lengths lie with its bytes).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.containers import read_containers
from kubetune_trainer.data.records import Columns, Stored
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage import stream
from kubetune_trainer.storage.confine import UnsafePath, confined
from kubetune_trainer.storage.members import MEMBERS, Member, SmallCache, open_container

# pyarrow reads a parquet file by exact ranges (its footer, each column chunk): a streamed file is
# read in small blocks, so a small chunk (a row group's captions, a struct column's paths) costs its
# own bytes, not a 1 MiB block (the index of 20,000 images read 367 MB more before the first step with
# stream.READ_BLOCK: benchmarks/RESULTS.md). A larger chunk is one exact ranged read either way.
READ_BLOCK = 16 * 1024
# pyarrow reads these files through a Python file object (open_container: a streamed file is ranged reads).
# Decoded on pyarrow's CPU thread pool, a process could abort as it exited, its work done ("terminate called
# without an active exception", exit 134: apache/arrow#34314): 1 in 60 indexing processes here, and a trainer
# that ends so fails its pod. On the calling thread it cannot; one column of one row group gains nothing from
# threads anyway (tests/storage/test_node_index.py runs many such processes).
PYARROW_THREADS = False
_ROW_GROUPS = SmallCache(entries=2)  # decoded image columns of the last row groups read, per process
# Each file's footer, read once while indexing (forked loader workers inherit it): a row group read
# later is then one ranged read of its column chunk, not three (a streamed file's footer costs two).
_FOOTERS: dict[Path, object] = {}


def read_parquet(root: Path, screen: Screen, columns: Columns) -> list[Stored]:
    return read_containers(root, screen, ".parquet", "*.parquet files (spec.data.format parquet reads Hugging Face "
                           "datasets saved as parquet)", lambda file: _index(root, file, columns),
                           f"parquet {columns!r}")


@dataclass(frozen=True)
class ParquetRow:
    """Row `index` of row group `row_group`; `root` resolves an image stored as a path."""

    row_group: int
    index: int
    column: str
    root: Path
    item: int | None = None  # the place in the row's list, for a list column

    @property
    def read_with(self) -> tuple[int, str]:
        """Rows read by one read of this one (its row group's column: storage.members companions)."""
        return self.row_group, self.column

    def read(self, member: Member) -> bytes:
        return self._image(member, self._values(member))

    def read_all(self, members: list[Member]) -> list[bytes]:
        """The bytes of MEMBERS, rows of this row group's column, from one read of it."""
        values = self._values(members[0])
        return [member.locator._image(member, values) for member in members]

    def _values(self, member: Member) -> list:
        return _ROW_GROUPS.get((member.container, self.row_group, self.column),
                               lambda: _image_column(member.container, self.row_group, self.column))

    def _image(self, member: Member, values: list) -> bytes:
        value = values[self.index] if self.item is None else values[self.index][self.item]
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                return value["bytes"]
            value = value.get("path")
        if isinstance(value, str):
            return stream.read_bytes(confined(self.root, value, f"image path in {member.container} {member.place}"))
        return value or b""  # nothing stored: the image check names the row


def _image_column(file: Path, row_group: int, column: str) -> list:
    import pyarrow.parquet as pq

    with open_container(file, READ_BLOCK) as handle:
        parquet = pq.ParquetFile(handle, metadata=_FOOTERS.get(file))
        _FOOTERS.setdefault(file, parquet.metadata)  # a process whose index came from the node's (data.node_index)
        return parquet.read_row_group(row_group, columns=[column], use_threads=PYARROW_THREADS).column(0).to_pylist()


@dataclass(frozen=True)
class ImageColumn:
    """One column of images in one file: how it stores them, and the path each row names (or None)."""

    name: str
    field: str          # the spec field naming it
    stored_as: str      # "struct", "bytes" or "path" (_stored_as)
    paths: list         # per row: its path (or None); of a list column, the list of its items' paths
    listed: bool = False  # a list of images per row (datasets' Sequence(Image()))


def _index(root: Path, file: Path, columns: Columns) -> list:
    """The file's samples as Stored records, and (where, why) for each bad row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text_column = columns.label if columns.wanted == "label" else columns.caption
    text_field = "labelColumn" if columns.wanted == "label" else "captionColumn"
    image_fields = [(columns.image, "imageColumn")] + ([(columns.control, "controlColumn")] if columns.edits else [])
    with open_container(file, READ_BLOCK) as handle:
        try:
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowInvalid, OSError) as err:
            raise ConfigError(f"{file}: not a readable parquet file ({err}); write it again (e.g. "
                              "datasets' Dataset.to_parquet) or remove it") from None
        schema = parquet.schema_arrow
        for column, field in (*image_fields, (text_column, text_field)):
            if column not in schema.names:
                raise ConfigError(f"{file}: no column {column!r} (spec.data.{field}); its columns are "
                                  f"{', '.join(schema.names)}: name the right one in spec.data.{field}")
        images = [_image_column_of(parquet, file, column, field) for column, field in image_fields]
        texts = parquet.read(columns=[text_column], use_threads=PYARROW_THREADS).column(0).to_pylist()
        metadata = _FOOTERS[file] = parquet.metadata
        classes = _class_names(schema, text_column) if columns.wanted == "label" else None
    found, row = [], 0
    relative = file.relative_to(root).as_posix()
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        for index in range(rows):
            where = f"{file} row {row}"
            refs = []
            for column in images:
                items = range(len(column.paths[row] or ())) if column.listed else [None]
                refs += [_image_of(root, file, relative, column, metadata.row_group(group), group, index, row,
                                   where, item) for item in items]
            problem = next((ref for ref in refs if isinstance(ref, tuple)), None)
            if problem is not None:
                found.append(problem)
            else:
                text = texts[row]
                record = {"label": text, "classes": classes} if columns.wanted == "label" else {"caption": text}
                found.append(Stored(refs[0], where, controls=tuple(refs[1:]), **record))
            row += 1
    return found


def _image_column_of(parquet, file: Path, column: str, field: str) -> ImageColumn:
    import pyarrow as pa

    image_type = parquet.schema_arrow.field(column).type
    listed = field == "controlColumn" and (pa.types.is_list(image_type) or pa.types.is_large_list(image_type))
    stored_as = _stored_as(image_type.value_type if listed else image_type)
    if stored_as is None:
        lists = ", or a list of them per row (datasets' Sequence(Image()))" if field == "controlColumn" else ""
        raise ConfigError(f"{file}: column {column!r} (spec.data.{field}) holds {image_type}, not images: it "
                          f"needs {{bytes, path}} structs (datasets' Image feature), bytes or paths{lists}")
    if listed:
        return ImageColumn(column, field, stored_as, _listed_paths(parquet, column, stored_as), listed=True)
    if stored_as == "bytes":
        return ImageColumn(column, field, stored_as, [None] * parquet.metadata.num_rows)
    read = f"{column}.path" if stored_as == "struct" else column  # a struct's paths, never its bytes
    values = parquet.read(columns=[read], use_threads=PYARROW_THREADS).column(0).to_pylist()
    return ImageColumn(column, field, stored_as,
                       [v and v.get("path") for v in values] if stored_as == "struct" else values)


def _listed_paths(parquet, column: str, stored_as: str) -> list[list]:
    """Per row, the paths of the items of a list column (None for an item without one): of structs
    read from the structs' path leaf alone (its name for list items, "list.element" or "list.item",
    is the writer's: taken from the file); of bytes, the column itself."""
    leaves = [parquet.metadata.schema.column(i).path for i in range(parquet.metadata.num_columns)]
    if stored_as == "struct":
        read = next(leaf for leaf in leaves if leaf.startswith(f"{column}.") and leaf.endswith(".path"))
        values = parquet.read(columns=[read], use_threads=PYARROW_THREADS).column(0).to_pylist()
        return [[item and item.get("path") for item in row or ()] for row in values]
    values = parquet.read(columns=[column], use_threads=PYARROW_THREADS).column(0).to_pylist()
    return [[item if stored_as == "path" else None for item in row or ()] for row in values]


def _image_of(root: Path, file: Path, relative: str, column: ImageColumn, row_group, group: int, index: int,
              row: int, where: str, item: int | None = None) -> Path | tuple[str, str]:
    """The path of one row's image in COLUMN (item ITEM of its list, for a list column): a loose file
    it names, or a member of the file; or (where, why) it cannot be."""
    path = column.paths[row] if item is None else column.paths[row][item]
    if column.stored_as == "path":
        try:
            image = confined(root, path or "", f"image path in {where}")
        except UnsafePath as err:
            return where, str(err)
        return image if image.is_file() else (where, f"its image {path} does not exist in {root}")
    listed = "" if item is None else f"[{item}]"
    share = _image_bytes(row_group, column.name) // max(row_group.num_rows, 1)
    if item is not None:  # a row's share of the column, split between its items
        share //= max(len(column.paths[row]), 1)
    member = Member(file, f"row {row}" + ("" if column.field == "imageColumn" else f" column {column.name}{listed}"),
                    path or f"{relative}:{row}{listed}", share, ParquetRow(group, index, column.name, root, item))
    return MEMBERS.add(member, f"row-{row}" + ("" if column.field == "imageColumn" else f".{column.name}")
                       + ("" if item is None else f".{item}"))


def _stored_as(image_type) -> str | None:
    """How an image column stores images: "struct" ({bytes, path}), "bytes", "path", or None."""
    import pyarrow as pa

    if pa.types.is_struct(image_type) and image_type.get_field_index("bytes") >= 0:
        return "struct" if image_type.get_field_index("path") >= 0 else None
    if pa.types.is_binary(image_type) or pa.types.is_large_binary(image_type):
        return "bytes"
    if pa.types.is_string(image_type) or pa.types.is_large_string(image_type):
        return "path"
    return None


def _image_bytes(row_group, column: str) -> int:
    return sum(row_group.column(i).total_uncompressed_size for i in range(row_group.num_columns)
               if row_group.column(i).path_in_schema.split(".")[0] == column)



def _class_names(schema, column: str) -> tuple[str, ...] | None:
    """The names of a ClassLabel label column, from the metadata datasets writes into the schema."""
    try:
        names = json.loads((schema.metadata or {})[b"huggingface"])["info"]["features"][column]["names"]
    except (KeyError, TypeError, ValueError):
        return None
    return tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None
