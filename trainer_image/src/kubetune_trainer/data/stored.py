"""Samples of spec.data.format parquet and webdataset: each format's reader yields Stored records
(data.records: an image path, its caption or label as stored), of which each layout's module makes its
samples (its LAYOUT.from_stored).

The records come in the data set's own order (files and shards by name, rows and members as they
lie in each), and each image is named as its loose file was (a parquet image's path, a shard
member's name): the same samples stored as loose files, as parquet or as WebDataset are then the
same list in the same order, so the sampler draws the same steps and training gives the same weights.
"""
from __future__ import annotations

from pathlib import Path

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data import parquet, webdataset
from kubetune_trainer.data.records import Stored, columns_of
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError


def read_stored(spec: TrainingJobSpec, screen: Screen) -> list[Stored]:
    readers = {"parquet": parquet.read_parquet, "webdataset": webdataset.read_webdataset}
    records = readers[spec.data.format](Path(spec.data.uri), screen, columns_of(spec))
    if not records:
        raise ConfigError(f"spec.data.uri: {spec.data.uri} holds no usable samples (spec.data.format "
                          f"{spec.data.format})")
    return records
