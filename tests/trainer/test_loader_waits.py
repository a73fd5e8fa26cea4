"""The data loader never waits for ever: a worker forked while the report's libraries import in the
background gets its batch (the fork waits for the imports), and a worker that gives no batch fails the
run naming the batch (loop.LOADER_WAIT_SECONDS)."""
from __future__ import annotations

import sys
import time

import pytest

from kubetune_trainer import loop
from kubetune_trainer.results.run_report import import_in_background

SLOW_MODULE = "kubetune_slow_report_dependency"


def in_a_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class ImportsInItsWorker:
    """A data set whose samples import SLOW_MODULE in a loader worker, as Image.open imports PIL's plugins
    there (the first step, loaded in the training process, imports nothing: the fork is what is tested)."""

    def __getitem__(self, keys):
        import importlib

        return importlib.import_module(SLOW_MODULE).VALUE if in_a_worker() else 0


class SlowInItsWorker:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __getitem__(self, keys):
        if in_a_worker():
            time.sleep(self.seconds)
        return 1


def worker_batch(dataset) -> object:
    """The second step's batch: the first step is loaded in the training process, the second by the worker."""
    steps = loop.iterate_steps(dataset, lambda batch: batch, 1, [[[(0, 0)]], [[(0, 1)]]], loader_seed=0)
    next(steps)
    return next(steps)[0][1]


def test_a_worker_forked_while_the_report_imports_run_gets_its_batch(tmp_path, monkeypatch):
    started = tmp_path / "importing"
    # The module's body runs for a second, as matplotlib's does: a fork in that second copied its import lock
    # held by the importing thread, and the worker's own import of it waited for ever.
    (tmp_path / f"{SLOW_MODULE}.py").write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(1.0)\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, SLOW_MODULE, raising=False)
    monkeypatch.setattr(loop, "LOADER_WAIT_SECONDS", 20)  # the bug's hang, bounded
    importing = import_in_background((SLOW_MODULE,))
    deadline = time.monotonic() + 20
    while not started.exists():
        assert time.monotonic() < deadline, "the background import did not start"
        time.sleep(0.01)
    assert importing.is_alive(), "the worker is forked while the import runs"

    assert worker_batch(ImportsInItsWorker()) == [7]


def test_a_worker_that_gives_no_batch_fails_naming_the_samples_it_waited_for(monkeypatch):
    monkeypatch.setattr(loop, "LOADER_WAIT_SECONDS", 1)
    with pytest.raises(loop.LoaderStalled, match=r"1 worker\(s\) gave no batch in 1 s \(samples \(0, 1\)\)"):
        worker_batch(SlowInItsWorker(3))
