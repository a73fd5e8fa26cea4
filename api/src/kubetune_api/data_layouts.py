"""The data layouts (spec.data.layout): one row each. The spec's Literal, its rules (and so the CRD's CEL),
the formats that can store each layout and what the trainer does with a layout's samples all read these
rows; nothing else names a layout, but the families' rows that say which layouts they read
(kubetune_api.families) and the trainer's module per layout.

How to add a layout:
  1. a row here: its name, what its samples are (clips, edits, labels), whether its loose files are read
     through metadata.jsonl, and the stored formats (spec.data.format) a data set of it can come in;
  2. its module kubetune_trainer/data/<name, "-" as "_">.py (data.layouts finds it by that name): its
     reader, keyed data set and collate, its tiny data writer (for tests and `kubetune dev tiny-data`),
     and where the row names stored formats its samples from their records and its loose samples (for
     data.restore_data), ending in `LAYOUT = Layout(...)` (data.layout_parts; captions.py is the model);
  3. the families that read it name it in their rows' `layouts`.
Nothing else changes: tests/unit/test_data_layouts_table.py checks that every row has its module and that
no other code asks which layout it is.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataLayout:
    name: str
    clips: bool = False      # a sample's media is a video clip: spec.data.frames is needed and fps applies
    edits: bool = False      # a sample is an edit pair: control images beside the target, its text the instruction
    labels: bool = False     # a sample carries a class label instead of a caption
    metadata: bool = False   # loose files list their samples in metadata.jsonl, whose keys imageColumn and
                             # captionColumn name
    stored: tuple[str, ...] = ()  # the formats besides loose files (spec.data.format) a data set may come in

    @property
    def captioned(self) -> bool:
        return not self.labels


STORED = ("parquet", "webdataset")
# In the CRD's order of spec.data.layout.
DATA_LAYOUTS: dict[str, DataLayout] = {row.name: row for row in (
    DataLayout("captions", metadata=True, stored=STORED),
    DataLayout("edit-pairs", edits=True, stored=STORED),
    DataLayout("pmg"),
    DataLayout("image-folder", labels=True, stored=STORED),
    DataLayout("video-captions", clips=True, metadata=True, stored=STORED),
)}


def layouts_where(**flags: bool) -> tuple[str, ...]:
    """The layouts whose row has these values, e.g. layouts_where(clips=True)."""
    return tuple(name for name, row in DATA_LAYOUTS.items()
                 if all(getattr(row, flag) == value for flag, value in flags.items()))


def stored_as(data_format: str) -> tuple[str, ...]:
    """The layouts a data set in spec.data.format `data_format` can hold ("files": every one)."""
    return tuple(name for name, row in DATA_LAYOUTS.items() if data_format == "files" or data_format in row.stored)
