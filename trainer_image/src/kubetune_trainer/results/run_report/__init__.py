"""A run's report: one HTML page with its curves, validation metrics and grids, the spec it trained,
its timing and where its weights are (kubetune_api.layout.REPORT_FILE).

The trainer writes it into the run's directory as the run ends (Run.publish); `kubetune report` writes
it for any run, finished or not, local or in S3. Both go through `write_report`.
"""
from __future__ import annotations

import importlib
import logging
import os
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from kubetune_api import layout
from kubetune_trainer.results.run_report.facts import GRID_FILE, LOGS, SAMPLES, gather
from kubetune_trainer.results.run_report.page import render
from kubetune_trainer.checkpoint.catalog import RunEntry
from kubetune_trainer.storage.tree import LocalTree, open_tree

log = logging.getLogger(__name__)


# What the report imports, ahead of time (import_in_background).
REPORT_MODULES = ("matplotlib.backends.backend_agg",  # the PNG canvas savefig uses
                  "matplotlib.figure", "tensorboard.backend.event_processing.event_accumulator")
# How long a fork (a DataLoader worker starting) waits for the background imports to finish: they take
# about a second; past this something else is wrong, and the loader's own bound (loop.LOADER_WAIT_SECONDS)
# names a worker that hangs.
FORK_WAITS_FOR_IMPORTS_SECONDS = 120
_importing: threading.Thread | None = None


def import_in_background(modules: tuple[str, ...] = REPORT_MODULES) -> threading.Thread:
    """Import matplotlib and TensorBoard's event reader on a daemon thread while the run trains (the trainer
    calls this as training starts): about a second on a small machine that every run would otherwise spend
    after its last step. A failure here is left to the report itself to meet and log.

    A process forked while this thread is inside an import (DataLoader workers are forked as the first step
    loads) inherits that module's import lock held by a thread it does not have: its first import of the
    module, or of one the module is importing (PIL's image plugins, which Image.open imports), then waits
    for ever. So every fork of this process first waits for these imports to finish (_before_fork)."""
    global _importing

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - imported again, and reported, when the report is written
                pass

    _importing = threading.Thread(target=load, name="report-imports", daemon=True)
    _importing.start()
    return _importing


def _before_fork() -> None:
    thread = _importing
    if thread is None or thread is threading.current_thread():
        return
    thread.join(FORK_WAITS_FOR_IMPORTS_SECONDS)
    if thread.is_alive():
        log.warning("thread %s still imports after %d s: forking anyway (a child importing the same modules "
                    "may hang)", thread.name, FORK_WAITS_FOR_IMPORTS_SECONDS)


os.register_at_fork(before=_before_fork)


def report_inputs(files: dict[str, int]) -> list[str]:
    """The files of a run the report reads: its job.yaml, TensorBoard events and validation grids."""
    return sorted(name for name in files if name == layout.JOB_FILE or name.startswith(f"{LOGS}/")
                  or (name.startswith(f"{SAMPLES}/") and name.endswith(f"/{GRID_FILE}")))


@contextmanager
def local_records(run: RunEntry, files: dict[str, int]):
    """A local directory holding what the report reads of RUN: the run itself when it is local, else a
    temporary copy of those files only (never its weights)."""
    tree = open_tree(run.uri)
    if isinstance(tree, LocalTree):
        yield tree.root
        return
    with tempfile.TemporaryDirectory(prefix="kubetune-report-") as folder:
        tree.fetch(report_inputs(files), Path(folder))
        yield Path(folder)


def write_page(text: str, out: Path) -> Path:
    """Write OUT whole or not at all: a temporary file beside it, renamed over it (a rename replaces a
    symbolic link itself, never the file it points to)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.chmod(partial, 0o644)
        os.replace(partial, out)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return out


def write_report(run: RunEntry, out: Path, local: Path | None = None, files: dict[str, int] | None = None) -> Path:
    """The report of RUN (as kubetune_trainer.checkpoint.catalog describes it) written to OUT.

    local: a directory already holding the run's records (the trainer's own run directory), else they are
    read from the run's URI. files: the run's files by relative name, else listed from the run's URI.
    """
    if files is None:
        files = open_tree(run.uri).files()
    if local is not None:
        return write_page(render(gather(run, local, files)), out)
    with local_records(run, files) as records:
        return write_page(render(gather(run, records, files)), out)
