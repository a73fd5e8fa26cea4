"""`kubetune evaluate`: how a trained run does on data it did not train on.

The data: the held-out split the trainer used (families.base.training_and_held_out, the same files
whatever machine asks), or every sample of another folder in the job's layout (--data).

- A family that predicts (evaluates_predictions: the classifier) runs its trained model over the
  images: predictions.csv (a row per image: path, label, prediction, confidence), metrics.json
  (classification_metrics.report) and confusion_matrix.png.
- A generating family draws each sample's image from its prompt (and control images) with the
  trained weights (generate_for) and scores it against the sample's own image (evaluation: ssim,
  clip_image, clip_text; an edit against its control image too: clip_directional; lpips_distance:
  lpips; hps with a preference model): images/, scores.csv
  (a row per sample) and metrics.json (the means). A video family's clips are scored frame by frame
  against the held-out clips (clip_evaluation) and written as clips/NNNN.mp4.

Everything is computed before anything is written; each file is written beside and renamed into
place, so a file (or a link) already in the output folder is replaced, never written through.
"""
from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJob, TrainingJobSpec
from kubetune_trainer.data.edit_pairs import IMAGE_SUFFIXES, EditPair
from kubetune_trainer.data.layouts import LAYOUTS
from kubetune_trainer.data.video_captions import CaptionedClip
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.base import reference_path, sample_name, training_and_held_out
from kubetune_trainer.results.sample_clips import Clip

NO_HELD_OUT = ("the job kept no held-out data (spec.validation.heldOutFraction is 0 and its layout names no "
               "held-out file): pass --data URI, a folder in the job's layout")


def with_data(spec: TrainingJobSpec, data: str) -> TrainingJobSpec:
    """The spec reading the folder `data` (loose files in the job's layout) instead of its own data."""
    return spec.model_copy(update={"data": spec.data.model_copy(update={"uri": data, "format": "files"})})


def read_data(spec: TrainingJobSpec, data: str) -> list:
    """Every sample of the folder `data`, read as the job's layout reads; a folder that is not in that
    layout is refused naming --data."""
    if not Path(data).is_dir():
        raise ConfigError(f"--data {data}: not a directory (give a local folder in the job's layout "
                          f"{spec.data.layout})")
    spec = with_data(spec, data)
    try:
        samples = LAYOUTS[spec.data.layout].read_samples(spec, screen_for(spec))
    except (ConfigError, FileNotFoundError) as err:
        reason = str(err).removeprefix("spec.data.uri: ")
        raise ConfigError(f"--data {data}: not a folder in the job's layout {spec.data.layout} ({reason})") from None
    if not samples:
        raise ConfigError(f"--data {data}: no {spec.data.layout} samples there")
    return samples


def screen_for(spec: TrainingJobSpec) -> Screen:
    return Screen(spec.data.skip_bad, LAYOUTS[spec.data.layout].check(spec))


def write_files(out: Path, files: dict[str, bytes]) -> list[Path]:
    """Write each file into `out` beside its final name, then rename it there."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        target = out / name
        if target.parent != out and target.parent.is_symlink():
            target.parent.unlink()  # a folder of ours that is a link elsewhere: replaced, not written through
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        partial.unlink(missing_ok=True)
        partial.write_bytes(content)
        os.replace(partial, target)  # replaces a link itself, never the file it points to
        written.append(target)
    return written


def _csv(header: list[str], rows: list[list]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return text.getvalue().encode()


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


# --- a family that predicts (the classifier) ------------------------------------------------------

@dataclass
class Predictions:
    names: list[str]        # each image's path relative to its data folder
    labels: torch.Tensor    # its class index in the model's classes
    predicted: torch.Tensor
    confidence: torch.Tensor


def labelled_samples(family, data: str | None) -> tuple[list, Callable]:
    """The held-out samples (or --data's) with labels in the model's classes, and how to name each."""
    if data is None:
        _, held_out = training_and_held_out(family.spec, family.read_samples(), family.screen)
        if not held_out:
            raise ConfigError(NO_HELD_OUT)
        return held_out, family.sample_name
    from kubetune_trainer.data.image_folder import LabelledImage

    samples = read_data(family.spec, data)
    classes = sorted({p.name for p in Path(data).iterdir() if p.is_dir() and not p.name.startswith(".")})
    unknown = [name for name in classes if name not in family.classes]
    if unknown:
        raise ConfigError(f"--data {data}: class folders {unknown} are not classes the model was trained on "
                          f"({', '.join(family.classes)})")
    index = {name: family.classes.index(name) for name in classes}
    relabelled = [LabelledImage(s.path, index[classes[s.label]]) for s in samples]
    return relabelled, lambda sample: sample_name(with_data(family.spec, data), sample)


@torch.no_grad()
def predict(family, model, samples: list, name: Callable, batch_size: int) -> Predictions:
    dataset = family.make_dataset(samples, training=False)
    names, labels, predicted, confidence = [], [], [], []
    for start in range(0, len(dataset), batch_size):
        indices = range(start, min(start + batch_size, len(dataset)))
        batch = family.collate([dataset[(0, i)] for i in indices])
        classes, probability = family.predict(model, batch["pixel_values"])
        names += [name(dataset.samples[i]) for i in indices]
        labels.append(batch["labels"])
        predicted.append(classes)
        confidence.append(probability)
    return Predictions(names, torch.cat(labels), torch.cat(predicted), torch.cat(confidence))


def confusion_figure(counts: list[list[int]], classes: list[str]):
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    from matplotlib.figure import Figure

    side = max(3.0, 0.6 * len(classes) + 1.5)
    figure = Figure(figsize=(side + 1, side))
    axes = figure.add_subplot()
    image = axes.imshow(counts, cmap="Blues")
    figure.colorbar(image, ax=axes)
    axes.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    axes.set_yticks(range(len(classes)), classes)
    axes.set_xlabel("predicted")
    axes.set_ylabel("actual")
    top = max(max(row) for row in counts) or 1
    for row, values in enumerate(counts):
        for column, value in enumerate(values):
            axes.text(column, row, str(value), ha="center", va="center",
                      color="white" if value > top / 2 else "black")
    return figure


def prediction_files(found: Predictions, classes: list[str], described: dict) -> dict[str, bytes]:
    from kubetune_trainer.results.classification_metrics import report

    metrics = {**report(found.predicted, found.labels, classes), **described}
    rows = [[name, classes[label], classes[predicted], f"{confidence:.6f}"] for name, label, predicted, confidence
            in zip(found.names, found.labels.tolist(), found.predicted.tolist(), found.confidence.tolist())]
    return {"predictions.csv": _csv(["path", "label", "prediction", "confidence"], rows),
            "metrics.json": _json(metrics),
            "confusion_matrix.png": _png(confusion_figure(metrics["confusion_matrix"]["counts"], classes))}


def evaluate_predictions(family, weights: Path, data: str | None, described: dict) -> dict[str, bytes]:
    """The files of a predicting family's evaluation."""
    samples, name = labelled_samples(family, data)
    model = family.load_trained(weights)
    found = predict(family, model, samples, name, family.spec.training.batch_size)
    return prediction_files(found, list(family.classes), described)


# --- a generating family --------------------------------------------------------------------------

def generation_samples(spec: TrainingJobSpec, data: str | None) -> list:
    """The samples whose images are generated and scored: the held-out split (or --data's), read as
    the layout reads, without loading any model."""
    if data is None:
        _, samples = training_and_held_out(spec, LAYOUTS[spec.data.layout].read_samples(spec, screen_for(spec)),
                                           screen_for(spec))
        if not samples:
            raise ConfigError(NO_HELD_OUT)
    else:
        samples = read_data(spec, data)
    if not isinstance(samples[0], CaptionedClip) and reference_path(samples[0]).suffix.lower() not in IMAGE_SUFFIXES:
        raise ConfigError(f"evaluate scores images and captioned clips; the {spec.data.layout} layout's samples are "
                          f"{reference_path(samples[0]).suffix} files")
    return samples


def prompt_of(sample) -> str:
    """What the image was generated from: a caption, or an edit's instruction."""
    return getattr(sample, "caption", None) or getattr(sample, "instruction", None) or ""


def generate_for(job: TrainingJob, weights: Path, samples: list, device: torch.device) -> list:
    """One RGB image (a video family: one sample_clips.Clip) per sample, in the samples' order (the scores pair image i with sample i's own
    image): the job's family on `device` with the weights in `weights` (the final ones or a checkpoint's),
    each sample drawn from its own inputs (caption; instruction and control images; user history) at
    spec.validation's steps and guidance, sample i with seed spec.training.seed + i."""
    from kubetune_trainer.results.generation import GenerationError, Generator

    try:
        generator = Generator(job, device)
        generator.load_weights(weights)
        return generator.draw_samples(samples, job.spec.training.seed)
    except GenerationError as err:
        raise ConfigError(str(err)) from None


def clip_scorer(source: str | None, device: torch.device, named: str = "spec.validation.clipModel"):
    """The CLIP model clip_image and clip_text are measured with, or None (SSIM alone); loaded before
    any image is generated, so a model that is not one is refused first (naming `named`, where it came from)."""
    from kubetune_trainer.results.evaluation import ClipScorer

    if not source:
        return None
    try:
        return ClipScorer(source, device)
    except ConfigError as err:
        raise ConfigError(str(err).replace("spec.validation.clipModel", named, 1)) from None


def lpips_scorer(source: str | None, device: torch.device):
    """The LPIPS network of --lpips-model (lpips_distance: a torchvision backbone and the paper's linear
    weights), or None; loaded before any image is generated, so a folder that is not one is refused first."""
    from kubetune_trainer.results.lpips_distance import LpipsDistance
    from kubetune_trainer.storage.inputs import local_copy

    return LpipsDistance(local_copy(source), device, source) if source else None


def hps_scorer(source: str | None, device: torch.device):
    """The human-preference model of --hps-model (a transformers CLIPModel folder, e.g. HPS v2 converted
    from its OpenCLIP checkpoint), or None; refused before any image is generated."""
    from kubetune_trainer.storage.inputs import local_copy

    return clip_scorer(source and local_copy(source), device, "--hps-model")


def refuse_image_scores_for_clips(samples: list, lpips, hps) -> None:
    """LPIPS and the HPS-style score are measured on images; a video family's clips get ssim and CLIP."""
    if samples and isinstance(samples[0], CaptionedClip):
        for option, given in (("--lpips-model", lpips), ("--hps-model", hps)):
            if given is not None:
                raise ConfigError(f"{option}: scores images, and this job's samples are video clips "
                                  "(scored with ssim and a CLIP model); leave it out")


def score_generated(generated: list, samples: list, clip, described: dict, fps: float | None = None,
                    lpips=None, hps=None) -> dict[str, bytes]:
    """The files of a generating family's evaluation: each generated image against its sample's own
    image (ssim; with a CLIP scorer clip_image), against its prompt (clip_text) and, an edit, the change
    from its first control image against its instruction (clip_directional, as validation scores it).
    With an LPIPS network, lpips against the sample's image; with a human-preference CLIP model, hps
    against the prompt. Clips (a video family's) frame by frame against the held-out clips read at `fps`
    (spec.data.fps)."""
    if len(generated) != len(samples):
        raise RuntimeError(f"generate_for returned {len(generated)} images for {len(samples)} samples")
    prompts = [prompt_of(sample) for sample in samples]
    if generated and isinstance(generated[0], Clip):
        return _scored_clips(generated, samples, prompts, clip, described, fps)
    from kubetune_trainer.results.evaluation import ssim

    references = [_read_rgb(reference_path(sample)) for sample in samples]
    scores = {"ssim": ssim(generated, references)}
    if clip is not None:
        scores["clip_image"] = clip.image_similarity(generated, references)
        scores["clip_text"] = clip.text_similarity(generated, prompts)
        if all(isinstance(sample, EditPair) for sample in samples):
            controls = [_read_rgb(sample.controls[0]) for sample in samples]
            scores["clip_directional"] = clip.directional_similarity(controls, generated, prompts)
    if lpips is not None:
        scores["lpips"] = lpips.scores(generated, references)
    if hps is not None:
        scores["hps"] = hps.preference_score(generated, prompts)
    images = {f"images/{i:04d}.png": _png_image(image) for i, image in enumerate(generated)}
    rows = [[f"images/{i:04d}.png", str(reference_path(sample)), prompts[i],
             *(f"{scores[metric].per_image[i]:.6f}" for metric in scores)] for i, sample in enumerate(samples)]
    metrics = {**{metric: found.mean for metric, found in scores.items()}, "samples": len(samples), **described}
    return {**images, "scores.csv": _csv(["image", "reference", "prompt", *scores], rows),
            "metrics.json": _json(metrics)}


def _read_rgb(path):
    """A sample's image by the rules its training read it with (image_input)."""
    from kubetune_trainer.data.image_input import to_rgb
    from kubetune_trainer.storage.stream import open_image

    with open_image(path) as image:
        return to_rgb(image)


def _scored_clips(generated: list, samples: list, prompts: list[str], clip, described: dict,
                  fps: float | None) -> dict[str, bytes]:
    from kubetune_trainer.results.clip_evaluation import clip_files, clip_scores, reference_frames

    references = [reference_frames(reference_path(sample), len(made.frames), fps)
                  for made, sample in zip(generated, samples)]
    scores = clip_scores(generated, references, prompts, clip)
    rows = [[f"clips/{i:04d}.mp4", str(reference_path(sample)), prompts[i], len(generated[i].frames),
             *(f"{scores[metric].per_image[i]:.6f}" for metric in scores)] for i, sample in enumerate(samples)]
    metrics = {**{metric: found.mean for metric, found in scores.items()}, "samples": len(samples), **described}
    return {**clip_files(generated), "scores.csv": _csv(["clip", "reference", "prompt", "frames", *scores], rows),
            "metrics.json": _json(metrics)}


def _png_image(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
