"""`kubetune report JOB`: one HTML page to look at a run (kubetune_trainer.results.run_report), written here.

The trainer writes the same page into the run's directory as the run ends; this writes it for any
run, also one still training or one whose page the trainer could not write.
"""
from __future__ import annotations

import os
from pathlib import Path

import click

from kubetune_api import layout
from kubetune_cli.runs import namespace_option, resolve, storage_errors, version_option
from kubetune_cli.trained import choose_run, fail

COMMAND = "report"


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out that would overwrite something unasked, or write through a symbolic link."""
    if out.is_symlink():
        fail(COMMAND, f"--out {out} is a symbolic link: kubetune never writes through one; remove it or pick "
                      "another path")
    if out.is_dir():
        fail(COMMAND, f"--out {out} is a directory: name the HTML file to write, e.g. --out {out / layout.REPORT_FILE}")
    if out.exists() and not force:
        fail(COMMAND, f"--out {out} exists: pass --force to replace it, or pick another path")
    if out.parent.exists() and not out.parent.is_dir():
        fail(COMMAND, f"--out {out}: {out.parent} is not a directory")


@click.command(COMMAND)
@click.argument("job")
@namespace_option
@version_option
@click.option("-o", "--out", "out", default=layout.REPORT_FILE, show_default=True, type=click.Path(),
              help="The HTML file to write (one file: the pictures are embedded).")
@click.option("--force", is_flag=True, help="Replace --out if it exists (never through a symbolic link).")
def report(job: str, namespace: str | None, version: int | None, out: str, force: bool) -> None:
    """Write one HTML page about a run of JOB: loss and learning-rate curves, validation metrics and grids
    over the steps (the base model first), timing, the spec it trained and where its weights are.

    JOB: a TrainingJob name on the current cluster, or the URI (local or s3://) of a job directory or of
    one run (.../v<N>).
    """
    from kubetune_trainer.results.run_report import write_report

    target = Path(out)
    check_out(target, force)
    run = choose_run(COMMAND, resolve(job, namespace), version)
    with storage_errors(run.uri):
        written = write_report(run, target)
    click.echo(f"wrote the report of {run.uri} to {written} ({os.path.getsize(written) / 2**20:.1f} MiB)")
