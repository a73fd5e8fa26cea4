"""What a layout's module gives the trainer (its LAYOUT): how its samples are read, made into a keyed data
set and batched, written again in a stored format and generated small. data.layouts finds each layout's
module by its name; kubetune_api.data_layouts' row says what the layout is.

A layout stored as parquet or WebDataset (spec.data.format) is read by that format's reader
(data.stored) into records, of which the layout's `from_stored` makes its samples; everything after
reading is the same as for loose files.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.records import Stored
from kubetune_trainer.data.screening import FileCheck, Screen
from kubetune_trainer.data.stored import read_stored


@dataclass(frozen=True)
class Layout:
    # Every sample (paths and texts, nothing decoded); bad records go to the Screen.
    read: Callable[[TrainingJobSpec, Screen], list]
    # A data set over some of the samples; training=False: the held-out set, without dropouts.
    dataset: Callable[[list, ImageTransform, TrainingJobSpec, bool], KeyedDataset]
    collate: Callable[[list[dict]], dict]
    # A small generated data set of the layout in out_dir (count, size, seed, then the writer's own options).
    write_tiny: Callable[..., Path]
    # The held-out samples when the layout names a file of them, else None (a fraction is split off).
    held_out: Callable[[TrainingJobSpec, Screen], list | None] = lambda spec, screen: None
    # How the screen checks each file of a sample before training (None: as an image).
    check: Callable[[TrainingJobSpec], FileCheck | None] = lambda spec: None
    # Its samples from the records of spec.data.format parquet or webdataset (None: loose files only).
    from_stored: Callable[[list[Stored], TrainingJobSpec, Screen], list] | None = None
    # Whether a streamed data set is screened before training too (else its files are checked as
    # training reaches them): where the sampler needs what the check finds before the first step.
    screen_streamed: Callable[[TrainingJobSpec], bool] = lambda spec: False
    # Its loose samples as data.restore_data stores them again in those formats: (media file, its name in
    # the data set, caption / class name / instruction, control images) each, in training order.
    loose: Callable[[Path], list[tuple[Path, str, str, tuple[Path, ...]]]] | None = None

    def read_samples(self, spec: TrainingJobSpec, screen: Screen) -> list:
        """Every sample, from loose files or from the format spec.data.format names."""
        if spec.data.format == "files":
            return self.read(spec, screen)
        return self.from_stored(read_stored(spec, screen), spec, screen)
