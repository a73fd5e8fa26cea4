"""A finished (or running) run as the commands that use it see it: which run of JOB, the TrainingJob
it trained (its job.yaml) and its weights at a step, on this machine.

`kubetune checkpoints pull`, `generate`, `export`, `evaluate` and `report` take JOB the same way
(kubetune_cli.runs.resolve: a TrainingJob name on the current cluster, or the URI of a job
directory or of one run) and pick the run and the step here, so each says the same thing about a
step that does not exist.
"""
from __future__ import annotations

from pathlib import Path

import click
import yaml

from kubetune_api import layout
from kubetune_api.failures import BAD_INPUT
from kubetune_cli.runs import Target, load_runs, storage_errors


def fail(command: str, message: str, code: int = BAD_INPUT) -> None:
    """One line naming the command; exit 2 for what the user asked wrong, 1 where the environment failed."""
    click.echo(f"kubetune {command}: {message}", err=True)
    raise SystemExit(code)


def check_step(command: str, step: str) -> None:
    # ASCII digits only: str.isdigit() takes '²' and '٣', which int() then refuses with a traceback
    if step not in ("latest", "final") and not (step.isascii() and step.isdigit()):
        fail(command, f"--step {step!r}: use a step number, latest or final")


def choose_run(command: str, target: Target, version: int | None):
    """The run `version` of the target, or the TrainingJob's current run, else the newest."""
    found = load_runs(target)
    if version is not None:
        run = next((r for r in found if r.version == version), None)
        if run is None:
            fail(command, f"--version {version}: no such run; there are "
                          f"{', '.join(f'v{r.version}' for r in found)}")
        return run
    current = [r for r in found if target.current and r.uri == target.current.rstrip("/")]
    return current[0] if current else found[-1]


def checkpoints_said(run) -> str:
    steps = [str(c.step) for c in run.checkpoints]
    return f"checkpoints at steps {', '.join(steps)}" if steps else "no complete checkpoint"


def resolve_step(command: str, run, step: str) -> int | str:
    """`step` (N, latest or final) as it exists in the run: a checkpoint's step number or "final"."""
    final = " and final weights" if run.final_files else ", no final weights (the run has not finished)"
    if step == "final":
        if not run.final_files:
            fail(command, f"{run.uri} has no final weights (the run has not finished); it has "
                          f"{checkpoints_said(run)}: use --step N or latest")
        return "final"
    steps = [c.step for c in run.checkpoints]
    if step == "latest":
        if steps:
            return steps[-1]
        if run.final_files:
            return "final"
        fail(command, f"{run.uri} has no complete checkpoint and no final weights yet: nothing to use")
    if int(step) not in steps:
        fail(command, f"--step {step}: {run.uri} has no complete checkpoint-{step}; it has "
                      f"{checkpoints_said(run)}{final}")
    return int(step)


def pull_weights(run, step: int | str, out: Path, force: bool = False) -> list[Path]:
    """Download the final weights or one checkpoint (verified against its manifest) into `out`;
    a file already there is replaced only with force."""
    from kubetune_trainer.checkpoint.catalog import pull_checkpoint, pull_final

    if step == "final":
        with storage_errors(run.uri):
            return pull_final(run, out, force)
    entry = run.checkpoint(step)
    with storage_errors(entry.uri):
        return pull_checkpoint(entry, out, force)


def step_label(step: int | str) -> str:
    return "final weights" if step == "final" else f"checkpoint-{step}"


def read_job(command: str, run):
    """The TrainingJob the run trained (its job.yaml), parsed by the spec it was written with."""
    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.storage.tree import open_tree

    with storage_errors(run.uri):
        text = open_tree(run.uri).read_text(layout.JOB_FILE)
    if text is None:
        fail(command, f"{run.uri} has no {layout.JOB_FILE}: the run was written by a kubetune that did not "
                      "record its TrainingJob; train it again with this version")
    return TrainingJob.model_validate(yaml.safe_load(text))


def check_pull_folder(command: str, out: Path) -> None:
    """`checkpoints pull -o`: a folder (new or not: files already there are checked one by one, see
    checkpoint.catalog.check_destinations), never a file, a link or the file system's root."""
    if out.is_symlink():
        fail(command, f"-o {out} is a symbolic link: kubetune never writes through one; give a real folder")
    if out.exists() and not out.is_dir():
        fail(command, f"-o {out} exists as a file: give a folder path (the file is left as it is)")
    resolved = out.resolve()
    if resolved == Path(resolved.anchor):
        fail(command, f"-o {out} is the file system's root: give a folder of its own, e.g. -o ./weights")


def check_out_folder(command: str, out: Path, force: bool) -> None:
    """--out: a new or empty folder, or with --force one to write into; never a file, never a link
    (nothing is written through one). Checked before anything is pulled or drawn."""
    if out.is_symlink():
        fail(command, f"--out {out} is a symbolic link: kubetune never writes through one; give a real folder")
    if out.exists() and not out.is_dir():
        fail(command, f"--out {out} exists as a file: give a folder path (the file is left as it is)")
    if out.is_dir() and any(out.iterdir()) and not force:
        fail(command, f"--out {out} is not empty: give a new folder, or pass --force to write into it")
