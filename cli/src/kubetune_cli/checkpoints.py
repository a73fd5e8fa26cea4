"""`kubetune checkpoints ls|pull`: find a job's runs and checkpoints, and download them.

JOB is a TrainingJob name or the URI of a job or run directory (kubetune_cli.runs says how each is found).
"""
from __future__ import annotations

from pathlib import Path

import click

from kubetune_api import layout
from kubetune_cli.runs import STEP_HELP, load_runs, namespace_option, resolve, version_option, when
from kubetune_cli.trained import check_pull_folder, check_step, choose_run, pull_weights, resolve_step, step_label
from kubetune_trainer.checkpoint.catalog import human_size


@click.group()
def checkpoints() -> None:
    """List and download the checkpoints and final weights of a job's runs."""


@checkpoints.command("ls")
@click.argument("job")
@namespace_option
def ls(job: str, namespace: str | None) -> None:
    """List every run of JOB and its complete checkpoints."""
    target = resolve(job, namespace)
    for run in load_runs(target):
        state = "finished" if run.record.finished else f"{run.record.steps} steps recorded, not finished"
        marker = "  <- current run" if target.current and run.uri == target.current.rstrip("/") else ""
        click.echo(f"{layout.version_name(run.version) if run.version is not None else run.uri}  "
                   f"({state}){marker}  {run.uri}")
        click.echo(f"  {'STEP':>8}  {'EPOCH':>5}  {'LOSS':>10}  {'SIZE':>10}  {'SAVED (UTC)':19}  URI")
        for entry in run.checkpoints:
            loss = f"{entry.loss:.5f}" if entry.loss is not None else "-"
            epoch = entry.epoch if entry.epoch is not None else "-"
            click.echo(f"  {entry.step:>8}  {epoch:>5}  {loss:>10}  {human_size(entry.size):>10}  "
                       f"{when(entry.saved_at):19}  {entry.uri}")
        if run.final_files:
            click.echo(f"  {'final':>8}  {'':>5}  {'':>10}  {human_size(sum(run.final_files.values())):>10}  "
                       f"{'':19}  {run.uri} ({', '.join(sorted(run.final_files))})")


@checkpoints.command("pull")
@click.argument("job")
@namespace_option
@click.option("--step", default="latest", show_default=True, metavar="N|latest|final", help=STEP_HELP)
@version_option
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to download into.")
@click.option("--force", is_flag=True, help="Replace files of the same names already in the directory.")
def pull(job: str, namespace: str | None, step: str, version: int | None, out_dir: str, force: bool) -> None:
    """Download a checkpoint (verified against its manifest) or the final weights of JOB."""
    check_step("checkpoints", step)
    out = Path(out_dir)
    check_pull_folder("checkpoints", out)
    run = choose_run("checkpoints", resolve(job, namespace), version)
    chosen = resolve_step("checkpoints", run, step)
    written = pull_weights(run, chosen, out, force)
    size = sum(p.stat().st_size for p in written)
    click.echo(f"pulled {step_label(chosen)} of {run.uri} ({len(written)} files, {human_size(size)}) into {out}")
