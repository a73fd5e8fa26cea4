"""A stored data set's containers (parquet files, WebDataset shards) indexed into records, in parallel and
once per node where streamed (data.node_index), in the data set's own order."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from kubetune_trainer.data import node_index
from kubetune_trainer.data.data_files import files_with
from kubetune_trainer.data.records import Stored
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError

INDEX_THREADS = 8  # containers are indexed in parallel: a streamed one costs a few ranged GETs


def data_files(root: Path, suffix: str) -> list[Path]:
    """The data set's files with SUFFIX, by name (the order of its samples), member copies aside."""
    if not root.is_dir():
        raise FileNotFoundError(f"spec.data.uri: {root} is not a directory")
    return files_with(root, (suffix,))


def read_containers(root: Path, screen: Screen, suffix: str, what: str, index: Callable[[Path], list],
                    reading: str) -> list[Stored]:
    """Every record of the data set's containers (files with SUFFIX, `what` names them when there are
    none): each indexed in parallel into Stored records and problems (once per node where streamed:
    data.node_index; READING names the format and columns the index reads), the problems reported
    to the screen in the containers' order, as they lie."""
    containers = data_files(root, suffix)
    if not containers:
        raise ConfigError(f"spec.data.uri: {root} holds no {what}")
    with ThreadPoolExecutor(INDEX_THREADS) as pool:
        indexed = list(pool.map(lambda container: node_index.indexed(container, reading, index), containers))
    records = []
    for found in indexed:
        for item in found:
            if isinstance(item, Stored):
                records.append(item)
            else:
                screen.reject(*item)
    return records
