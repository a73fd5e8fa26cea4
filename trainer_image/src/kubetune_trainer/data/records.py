"""The records a stored data set is read into: one Stored per sample (its image as a loose file or a
member, its caption or label as stored, its control images), and the columns a layout reads.

Parquet files and WebDataset shards (data.parquet, data.webdataset) yield them, data.node_index keeps
them once per node, data.stored makes each layout's samples of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kubetune_api.data_layouts import DATA_LAYOUTS
from kubetune_api.spec_data import data_columns
from kubetune_api.spec import TrainingJobSpec


@dataclass(frozen=True)
class Stored:
    image: Path               # a loose file, or a member path (storage.members)
    where: str                # how messages name the sample: "FILE row 3", "SHARD sample 0003"
    caption: object = None    # as stored (a caption must be text)
    label: object = None      # as stored: a class index, or a class name
    classes: tuple[str, ...] | None = None  # the names of the class indices, where the file has them
    controls: tuple[Path, ...] = ()         # edit pairs: the control images, in order


@dataclass(frozen=True)
class Columns:
    image: str | None
    caption: str
    label: str | None
    control: str | None
    wanted: str               # "caption" or "label": which of the two the layout reads
    edits: bool = False       # edit pairs: control images too (the caption is the instruction)
    clips: bool = False       # a video layout: the "image" of a sample is a video clip


def columns_of(spec: TrainingJobSpec) -> Columns:
    image, caption, label, control = data_columns(spec.data)
    row = DATA_LAYOUTS[spec.data.layout]
    return Columns(image, caption, label, control, "label" if row.labels else "caption", edits=row.edits,
                   clips=row.clips)
