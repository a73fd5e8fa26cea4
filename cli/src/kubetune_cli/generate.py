"""`kubetune generate JOB`: images from a run's weights (or its base model), to look at.

A shell over kubetune_trainer.results.generation: JOB and the step are picked as `kubetune checkpoints pull`
picks them (kubetune_cli.trained), the weights are pulled into a temporary folder, and the images,
each with its prompt, seed and step in its PNG text, go to --out with a grid.png.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import click

from kubetune_cli.runs import STEP_HELP, is_uri, namespace_option, resolve, version_option

COMMAND = "generate"


def default_out(job_name: str, step: int | str, base: bool, compare: bool) -> Path:
    label = "base" if base else f"step-{step}" if isinstance(step, int) else step
    return Path("kubetune-generate") / f"{job_name}-{label}{'-compare' if compare else ''}"


@click.command("generate")
@click.argument("job")
@namespace_option
@click.option("--step", default="final", show_default=True, metavar="N|latest|final", help=STEP_HELP)
@version_option
@click.option("--prompt", "prompts", multiple=True,
              help="A prompt to draw (repeatable); default: the job's validation prompts, else its held-out "
                   "samples (edit families: held-out pairs; PMG: held-out users).")
@click.option("--control", "controls", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Edit families: a control image to edit, one per --prompt, in order (repeatable).")
@click.option("--base", is_flag=True, help="Draw with the base model alone (no trained weights).")
@click.option("--compare", is_flag=True, help="Draw with the base model and the trained weights: both rows "
                                              "in one grid.png.")
@click.option("--steps", type=click.IntRange(1, 1000), default=None,
              help="Denoising steps (default: the job's spec.validation.numInferenceSteps).")
@click.option("--guidance", type=click.FloatRange(0, 100), default=None,
              help="Guidance scale (default: spec.validation.guidanceScale, else the family's).")
@click.option("--seed", type=int, default=None, help="Seed of the draw (default: the job's spec.training.seed).")
@click.option("--count", type=click.IntRange(1, 64), default=None,
              help="Held-out samples to draw without --prompt (default: spec.validation.numSamples).")
@click.option("--device", default=None, help="torch device (default: cuda when there is one, else cpu).")
@click.option("-o", "--out", "out_dir", default=None, type=click.Path(path_type=Path),
              help="Folder for the PNGs and grid.png (default: ./kubetune-generate/<job>-<step>).")
@click.option("--force", is_flag=True, help="Write into a non-empty --out.")
@click.option("--on-cluster", is_flag=True,
              help="Draw in a Kubernetes Job on the cluster (the trainer image, the job's credentials, a GPU when "
                   "the job trains on GPUs); the images go beside the run in S3, <run>/generated/<label>/, and "
                   "--out downloads them. JOB must be a TrainingJob name.")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="--on-cluster: wait for the images (else print where they will be and return).")
@click.option("--timeout", type=click.IntRange(1), default=3600, show_default=True,
              help="--on-cluster: seconds to wait for the images.")
def generate(job: str, namespace: str | None, step: str, version: int | None, prompts: tuple[str, ...],
             controls: tuple[Path, ...], base: bool, compare: bool, steps: int | None, guidance: float | None,
             seed: int | None, count: int | None, device: str | None, out_dir: Path | None, force: bool,
             on_cluster: bool, wait: bool, timeout: int) -> None:
    """Draw images with JOB's trained weights (a TrainingJob name or the URI of a job or run directory),
    its base model (--base), or both side by side (--compare)."""
    from kubetune_cli.trained import check_out_folder, check_step, choose_run, fail, read_job, resolve_step

    check_step(COMMAND, step)
    if base and compare:
        fail(COMMAND, "--base and --compare: --compare draws the base already; pass one of them")
    if on_cluster:
        check_on_cluster(job, controls, device, wait, out_dir)
    target = resolve(job, namespace)
    run = choose_run(COMMAND, target, version)
    chosen = "base" if base else resolve_step(COMMAND, run, step)
    trained = read_job(COMMAND, run)
    if on_cluster:
        from kubetune_trainer.results.generation import draws_images

        if not draws_images(trained.spec.model.family):
            fail(COMMAND, f"{trained.spec.model.family} draws no images; use kubetune evaluate")
        if out_dir is not None:
            check_out_folder(COMMAND, out_dir, force)
        from kubetune_cli.generate_on_cluster import generate_on_cluster

        generate_on_cluster(COMMAND, job, target.namespace, run, chosen, compare, prompts, steps, guidance, seed,
                            count, out_dir, wait, timeout)
        return
    out = out_dir or default_out(trained.metadata.name, chosen, base, compare)
    check_out_folder(COMMAND, out, force)

    import torch

    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.results.generation import GenerationError, Generator, Request, check_request, save_grid, save_images

    request = Request(prompts=prompts, controls=controls, steps=steps, guidance=guidance, seed=seed, count=count)
    try:
        check_request(trained.spec.model.family, request)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        generator = Generator(trained, device)
        rows = []
        if base or compare:
            rows.append(generator.generate(request))
        if not base:
            rows.append(_generate_trained(generator, run, chosen, request))
    except (GenerationError, ConfigError) as err:
        fail(COMMAND, str(err))
    out.mkdir(parents=True, exist_ok=True)
    written = [path for row in rows for path in save_images(row, out)]
    grid = save_grid(rows, out)
    click.echo(f"wrote {len(written)} image(s) and {grid} ({', '.join(str(row[0].step) for row in rows)}) into {out}")


def check_on_cluster(job: str, controls: tuple[Path, ...], device: str | None, wait: bool, out_dir: Path | None) -> None:
    """What --on-cluster cannot take: a URI (the operator acts on a TrainingJob), files on this machine."""
    from kubetune_cli.trained import fail

    if is_uri(job):
        fail(COMMAND, f"--on-cluster: JOB {job!r} is a URI; give the TrainingJob's name (the operator draws for it)")
    if controls:
        fail(COMMAND, "--on-cluster: --control images are files on this machine, out of the pod's reach; "
                      "draw the job's held-out pairs (leave out --control), or generate here")
    if device:
        fail(COMMAND, "--on-cluster: --device is for drawing here; the pod uses its GPU when the job has one")
    if out_dir is not None and not wait:
        fail(COMMAND, "--on-cluster: --out with --no-wait: the images can be downloaded only once they exist; "
                      "drop one of them")


def _generate_trained(generator, run, step: int | str, request):
    from kubetune_cli.trained import pull_weights

    with tempfile.TemporaryDirectory(prefix="kubetune-generate-") as folder:
        pull_weights(run, step, Path(folder))
        generator.load_weights(Path(folder), step)
    return generator.generate(request)

