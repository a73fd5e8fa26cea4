"""`kubetune evaluate JOB`: score a trained run on data it did not train on (kubetune_trainer.results.run_evaluation).

JOB as `kubetune checkpoints` takes it; the run and step as kubetune_cli.trained picks them. The
output folder must be new or empty (or --force); nothing is written until every figure is computed.
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

import click

from kubetune_cli.runs import STEP_HELP, namespace_option, resolve, version_option
from kubetune_cli.trained import check_out_folder, check_step, choose_run, fail, pull_weights, read_job, resolve_step, step_label

COMMAND = "evaluate"


def pick_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        fail(COMMAND, "--device cuda: no CUDA GPU here; use --device cpu")
    return torch.device(name)


@click.command("evaluate")
@click.argument("job")
@namespace_option
@click.option("--data", default=None, metavar="URI",
              help="A folder (local or s3://) in the job's data layout to evaluate on; default: the held-out "
                   "split the run trained without.")
@click.option("--out", "out_dir", default=None, type=click.Path(),
              help="Folder for the results; default ./<job>-v<N>-<step>-evaluation.")
@click.option("--step", default="final", show_default=True, metavar="N|latest|final", help=STEP_HELP)
@version_option
@click.option("--force", is_flag=True, help="Write into a non-empty --out, replacing the files evaluate writes.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]),
              help="Where the model runs (auto: a CUDA GPU when there is one).")
@click.option("--clip-model", default=None, metavar="URI",
              help="CLIP model for clip_image and clip_text (generating families); default "
                   "spec.validation.clipModel; without one only SSIM is measured.")
@click.option("--lpips-model", default=None, metavar="URI",
              help="Folder (local or s3://) with backbone.pth (torchvision's AlexNet or VGG16 weights) and "
                   "linear.pth (the LPIPS v0.1 linear weights of that network): adds lpips (images).")
@click.option("--hps-model", default=None, metavar="URI",
              help="Human-preference model in the transformers CLIP layout (e.g. HPS v2 converted from "
                   "OpenCLIP): adds hps, 100 x its image-prompt cosine (images).")
def evaluate(job: str, namespace: str | None, data: str | None, out_dir: str | None, step: str,
             version: int | None, force: bool, device: str, clip_model: str | None, lpips_model: str | None,
             hps_model: str | None) -> None:
    """Evaluate a trained run of JOB on its held-out data (or --data).

    Classifier: predictions.csv, metrics.json (accuracy, macro and per-class precision, recall, F1)
    and confusion_matrix.png. Generating families: each sample's image generated from its prompt
    (and control images) and scored against the sample's image: images/, scores.csv and
    metrics.json (ssim; clip_image and clip_text with a CLIP model; lpips with --lpips-model; hps
    with --hps-model)."""
    check_step(COMMAND, step)
    run = choose_run(COMMAND, resolve(job, namespace), version)
    chosen = resolve_step(COMMAND, run, step)
    trained = read_job(COMMAND, run)
    label = "final" if chosen == "final" else f"step-{chosen}"
    out = Path(out_dir or f"{trained.metadata.name}-v{run.version}-{label}-evaluation")
    check_out_folder(COMMAND, out, force)
    described = {"run": run.uri, "weights": step_label(chosen), "data": data or "held-out split"}
    scorers = {"lpips_model": lpips_model, "hps_model": hps_model}
    with configuration_errors():
        spec, data = local_inputs(trained.spec, data)  # --data is checked before anything is pulled
    with tempfile.TemporaryDirectory(prefix="kubetune-evaluate-") as scratch:
        weights = Path(scratch) / "weights"
        pull_weights(run, chosen, weights)
        with configuration_errors():
            files = _evaluate(trained, spec, weights, data, pick_device(device), clip_model, described,
                               **scorers)
    from kubetune_trainer.results.run_evaluation import write_files

    write_files(out, files)
    summary = {k: v for k, v in json_of(files["metrics.json"]).items() if isinstance(v, float)}
    click.echo(f"evaluated {step_label(chosen)} of {run.uri} on {described['data']}: "
               + ", ".join(f"{name} {value:.4f}" for name, value in summary.items()))
    click.echo(f"wrote {', '.join(sorted({name.split('/')[0] for name in files}))} into {out}")


def json_of(content: bytes) -> dict:
    import json

    return json.loads(content)


@contextmanager
def configuration_errors():
    """The trainer's refusals (a field, a file, an option and the fix) as one line."""
    from kubetune_trainer.errors import ConfigError

    try:
        yield
    except ConfigError as err:
        fail(COMMAND, str(err))


def local_inputs(spec, data: str | None):
    """The job's spec with this machine's copies of its models and data, and of --data (checked to be
    in the job's layout)."""
    from kubetune_trainer.run import with_local_inputs
    from kubetune_trainer.results.run_evaluation import read_data
    from kubetune_trainer.storage.inputs import local_copy

    spec = with_local_inputs(spec)
    if data is not None:
        data = local_copy(data)
        read_data(spec, data)
    return spec, data


def _evaluate(trained, spec, weights: Path, data: str | None, device, clip_model: str | None, described: dict,
              lpips_model: str | None = None, hps_model: str | None = None):
    import torch
    import transformers

    from kubetune_trainer.results import run_evaluation
    from kubetune_trainer.families import family_for
    from kubetune_trainer.storage.inputs import local_copy

    transformers.utils.logging.disable_progress_bar()  # one summary line, not a bar per model loaded
    family_class = family_for(spec.model.family)
    if family_class.evaluates_predictions:
        family = family_class(spec, device, torch.float32)
        return run_evaluation.evaluate_predictions(family, weights, data, described)
    samples = run_evaluation.generation_samples(spec, data)
    clip_source = clip_model or spec.validation.clip_model
    described["clip_model"] = clip_source
    run_evaluation.refuse_image_scores_for_clips(samples, lpips_model, hps_model)
    clip = run_evaluation.clip_scorer(clip_source and local_copy(clip_source), device,
                                      "--clip-model" if clip_model else "spec.validation.clipModel")
    lpips = run_evaluation.lpips_scorer(lpips_model, device)
    hps = run_evaluation.hps_scorer(hps_model, device)
    described.update({name: source for name, source in (("lpips_model", lpips_model), ("hps_model", hps_model))
                      if source})
    generated = run_evaluation.generate_for(trained, weights, samples, device)
    return run_evaluation.score_generated(generated, samples, clip, described, spec.data.fps, lpips, hps)
