"""`kubetune`: the command line.

Each command is a thin shell over a library call; heavy imports (torch, the Kubernetes client)
happen inside the command that needs them, so `kubetune validate` starts in a blink on a machine
with only the spec installed.
"""
from __future__ import annotations

import sys
from typing import get_args
from pathlib import Path

import click

from kubetune_api.failures import BAD_INPUT
from kubetune_api.manifest import ManifestError, load_manifest
from kubetune_api.families import FAMILY_NAMES
from kubetune_api.spec_data import Layout
from kubetune_cli.debug import ANOMALY_FLAG, DEBUG_STEPS, debug_overrides

FAMILIES = FAMILY_NAMES
# Every layout the API accepts: each has tiny data.
LAYOUTS = sorted(get_args(Layout))


class AnsweringGroup(click.Group):
    """The top-level group: whatever a command raises that it did not answer itself is answered
    here, from the one table (kubetune_api.failures), in one line on stderr with its exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - this is the place every error is answered
            exit_with_answer(ctx, err)


def exit_with_answer(ctx: click.Context, err: BaseException) -> None:
    import os

    from kubetune_api.failures import answer, answer_unexpected

    if os.environ.get("KUBETUNE_TRACEBACK"):
        raise err
    found = answer(err) or answer_unexpected(err)
    command = " ".join(filter(None, ["kubetune", ctx.invoked_subcommand]))
    click.echo(f"{command}: {found.message}", err=True)
    sys.exit(found.code)


@click.group(cls=AnsweringGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Kubernetes-native fine-tuning of image-generation models."""


@cli.command()
@click.option("-f", "--filename", "path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The TrainingJob manifest, the same file you would `kubectl apply`.")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE",
              help="Override a field, e.g. --set spec.training.maxSteps=2 (repeatable).")
def validate(path: str, overrides: tuple[str, ...]) -> None:
    """Check a manifest (a TrainingJob or a TrainingSweep) and print the verdict the cluster will give."""
    try:
        if is_sweep(Path(path)):
            from kubetune_api.sweep import load_sweep

            sweep = load_sweep(Path(path))
            click.echo(f"{path}: valid TrainingSweep {sweep.metadata.name!r} ({sweep.spec.algorithm}, "
                       f"{sweep.spec.max_trials} trials over {', '.join(sweep.spec.parameters)})")
            return
        job = load_manifest(Path(path), overrides)
    except ManifestError as err:
        click.echo(f"{path}: invalid\n{err}", err=True)
        sys.exit(BAD_INPUT)
    click.echo(f"{path}: valid TrainingJob {job.metadata.name!r} (family {job.spec.model.family})")
    from kubetune_api.cluster_paths import refusals

    for message in refusals(job.spec):  # local paths are fine for `kubetune train -f`, not in a pod
        click.echo(f"{path}: on a cluster, kubectl apply refuses it: {message}", err=True)


def is_sweep(path: Path) -> bool:
    """Whether the file holds a TrainingSweep (a cheap look: validation reads it properly)."""
    return any(line.strip() == "kind: TrainingSweep" for line in path.read_text(errors="replace").splitlines())


@cli.command()
@click.option("-f", "--filename", "path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The TrainingSweep manifest, the same file you would `kubectl apply`.")
@click.option("--parallel", default=None, type=click.IntRange(1, 64),
              help="Trials at once (default: spec.parallelTrials).")
@click.option("--workdir", default=None, type=click.Path(file_okay=False),
              help="Where the trials' manifests and logs go (default: ./kubetune-sweeps/<name>).")
@click.option("--force", is_flag=True, help="Replace the manifests and logs an earlier sweep left in the workdir.")
def sweep(path: str, parallel: int | None, workdir: str | None, force: bool) -> None:
    """Run a TrainingSweep's trials on this machine and print each trial and the best."""
    from kubetune_api.sweep import load_sweep
    from kubetune_cli.sweep import LocalSweep

    try:
        loaded = load_sweep(Path(path))
    except ManifestError as err:
        click.echo(f"{path}: invalid\n{err}", err=True)
        sys.exit(BAD_INPUT)
    folder = Path(workdir or Path("kubetune-sweeps") / loaded.metadata.name)
    earlier = sorted(folder.glob(f"{loaded.metadata.name}-*.log")) if folder.is_dir() else []
    if earlier and not force:
        click.echo(f"kubetune sweep: {folder} holds the trial logs of an earlier sweep {loaded.metadata.name!r} "
                   f"({earlier[0].name}, ...): pass --workdir DIR for this one, or --force to replace them (its runs "
                   "are kept either way: every sweep's trials get runs of their own)", err=True)
        sys.exit(BAD_INPUT)
    runner = LocalSweep(loaded, folder, parallel, echo=lambda line: click.echo(line, err=True))
    succeeded = runner.run()
    click.echo(runner.table())
    sys.exit(0 if succeeded else 1)


@cli.command()
@click.option("-f", "--filename", "path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The TrainingJob manifest, the same file you would `kubectl apply`.")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE",
              help="Override a field, e.g. --set spec.training.maxSteps=2 (repeatable).")
@click.option("--nproc", default=None, type=click.IntRange(1, 64),
              help="Processes on this machine; default: the job's processes per node (one per GPU, "
                   "or spec.distributed.processesPerNode on the CPU, where they train together over gloo).")
@click.option("--cache-only", is_flag=True,
              help="Only encode every sample into the embedding cache (spec.data.cache), then stop.")
@click.option("--debug", is_flag=True,
              help=f"A quick check of the whole path: {DEBUG_STEPS} steps, a tiny validation, autograd anomaly "
                   "detection, nothing uploaded (s3:// checkpoints go to ./kubetune-debug instead).")
def train(path: str, overrides: tuple[str, ...], nproc: int | None, cache_only: bool, debug: bool) -> None:
    """Train locally from a TrainingJob manifest."""
    try:
        job = load_manifest(Path(path), overrides)
        if debug:
            debugged = debug_overrides(job, Path.cwd() / "kubetune-debug")
            job = load_manifest(Path(path), (*overrides, *debugged))
            click.echo(f"debug run: {' '.join(debugged)}", err=True)
    except ManifestError as err:
        click.echo(f"{path}: invalid\n{err}", err=True)
        sys.exit(BAD_INPUT)
    from kubetune_trainer.process.start import launch_local

    trainer_args = (("--cache-only",) if cache_only else ()) + ((ANOMALY_FLAG,) if debug else ())
    sys.exit(launch_local(job, nproc=nproc, trainer_args=trainer_args))


@cli.group()
def dev() -> None:
    """Development tools: tiny models and the local control plane."""


@dev.command("tiny-model")
@click.option("--family", required=True, type=click.Choice(list(FAMILIES)), help="Model family.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write the model into (standard diffusers layout).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option("--full-size", is_flag=True, help="The real architecture (GBs) instead of a toy one, for benchmarks.")
@click.option("--config-only", is_flag=True,
              help="With --full-size: only the configs of the real architecture, no weights (any family; "
                   "what `kubetune plan` reads).")
def tiny_model(family: str, out_dir: str, seed: int, full_size: bool, config_only: bool) -> None:
    """Write a small random-weight model of a family, loadable with from_pretrained."""
    from kubetune_trainer.models.tiny_models import write_tiny_model

    if config_only and not full_size:
        raise click.UsageError("--config-only writes the real architecture's configs: add --full-size")
    path = write_tiny_model(family, Path(out_dir), seed=seed, full_size=full_size, config_only=config_only)
    what = "configs (no weights) of the full-size" if config_only else (
        "full-size random-weight" if full_size else "tiny random-weight")
    click.echo(f"wrote {what} {family} model to {path}")


@dev.command("tiny-clip")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write the CLIP model into (transformers layout).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
def tiny_clip(out_dir: str, seed: int) -> None:
    """Write a small random-weight CLIP model, usable as spec.validation.clipModel."""
    from kubetune_trainer.models.tiny_models import write_tiny_clip

    click.echo(f"wrote a tiny random-weight CLIP model to {write_tiny_clip(Path(out_dir), seed=seed)}")


@dev.command("tiny-data")
@click.option("--layout", required=True, type=click.Choice(LAYOUTS), help="Data layout.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write into.")
@click.option("--count", default=8, show_default=True, type=click.IntRange(1, 100_000), help="Number of samples.")
@click.option("--size", default=64, show_default=True, type=click.IntRange(8, 4096), help="Image size in pixels.")
@click.option("--seed", default=0, show_default=True, help="Seed of the generated content.")
def tiny_data(layout: str, out_dir: str, count: int, size: int, seed: int) -> None:
    """Write a small generated data set in a layout (coloured shapes with captions)."""
    from kubetune_trainer.data.tiny_data import write_tiny_data

    path = write_tiny_data(layout, Path(out_dir), count=count, size=size, seed=seed)
    click.echo(f"wrote {count} {layout} samples to {path}")


def _add_checkpoint_commands() -> None:
    from kubetune_cli.checkpoints import checkpoints
    from kubetune_cli.evaluate import evaluate
    from kubetune_cli.generate import generate
    from kubetune_cli.export import export
    from kubetune_cli.models import models
    from kubetune_cli.plan import plan
    from kubetune_cli.report import report

    cli.add_command(checkpoints)
    cli.add_command(evaluate)
    cli.add_command(generate)
    cli.add_command(export)
    cli.add_command(models)
    cli.add_command(plan)
    cli.add_command(report)


_add_checkpoint_commands()


def _add_control_plane_commands() -> None:
    from kubetune_dev.cli import COMMANDS

    for command in COMMANDS:
        dev.add_command(command)


_add_control_plane_commands()


if __name__ == "__main__":
    cli()
