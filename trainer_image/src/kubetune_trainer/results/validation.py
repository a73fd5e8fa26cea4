"""Validation during training: held-out metrics, sample images, early stopping, the best K weights.

Samples go under the run's samples/step-NNNNNNN/ (mirrored to an s3:// run), to TensorBoard and, through
on_samples, to the MLflow run: images as PNGs and a grid; a video family's clips (sample_clips.Clip)
as .mp4 and animated GIF.

Every process evaluates the same held-out batches with the same per-sample draws (randomness.py:
the same noise at every validation, so checkpoints compare fairly), so all reach the same
early-stopping decision without talking to each other; only the main process writes. The CLIP
metrics of the sample images (evaluation.py, with spec.validation.clipModel) are the exception: the
main process scores its images and hands every process its scores, so they still decide alike.
Under FSDP the model's forward is a collective, so sampling images and gathering the best weights
involve every process too. Validation runs inside `torch.random.fork_rng`, so it never shifts the
training's random stream (a resumed run stays bitwise identical whether or not it validated).
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from kubetune_api.contract import TrainerLog
from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.data.sampler import in_order
from kubetune_trainer.results.drawing import Draw
from kubetune_trainer.training.randomness import VALIDATION_STEP, SampleRandom
from kubetune_trainer.results.sample_clips import Clip, record_clips

log = logging.getLogger("kubetune.trainer")
HIGHER_IS_BETTER = {"loss": False, "accuracy": True, "precision": True, "recall": True, "f1": True,
                    "clip_score": True, "clip_directional": True}


def improves(value: float, best: float | None, metric: str) -> bool:
    if best is None:
        return True
    return value > best if HIGHER_IS_BETTER[metric] else value < best


def _alone(decide: Callable[[], Any]) -> Any:
    return decide()


class Validator:
    """from_main(decide): decide() run on the main process, its result (or ConfigError) on every
    process: a collective (Run._agree); a single process just calls it."""

    def __init__(self, spec: TrainingJobSpec, family, held_out, output: Path, is_main: bool, sharded: bool = False,
                 from_main: Callable[[Callable[[], Any]], Any] = _alone,
                 on_samples: Callable[[int, list[Path]], None] = lambda step, files: None):
        self.spec = spec.validation
        self.draw = Draw.for_validation(spec)  # the same prompts and seed at every validation
        self.seed = spec.training.seed
        self.batch_size = spec.training.batch_size
        self.family = family
        self.held_out = held_out
        self.output = output
        self.is_main = is_main
        self.sharded = sharded
        self.best: float | None = None
        self.validations_without_improvement = 0
        self._writer = None
        self.from_main = from_main
        self.on_samples = on_samples  # the sample files written at a step (the MLflow run gets them)
        self.clip = None  # the main process's CLIP scorer
        self._said_nothing_to_score = False
        if self.spec.clip_model:
            self.from_main(self._load_clip)  # now, so that a bad clipModel fails the job before it trains

    def _load_clip(self) -> None:
        from kubetune_trainer.results.evaluation import ClipScorer

        self.clip = ClipScorer(self.spec.clip_model, self.family.device)

    def due(self, step: int, total_steps: int) -> bool:
        every = self.spec.every_steps
        return every is not None and (step % every == 0 or step == total_steps)

    def _held_out_batches(self) -> list[tuple[dict, SampleRandom]]:
        if self.held_out is None:
            return []
        return [(batch, SampleRandom.for_keys(self.seed, batch_keys, VALIDATION_STEP))
                for batch_keys, batch in ordered_batches(self.held_out, self.batch_size, self.family.collate)]

    def run(self, model: torch.nn.Module, step: int, trained_state: Callable[[], dict] | None = None,
            ranked: bool = True) -> dict[str, float]:
        """Evaluate and sample at `step`; returns the metrics: the held-out ones (none without held-out
        data) and, with spec.validation.clipModel, the CLIP scores of the sample images.

        trained_state: the weights to publish, whole on the main process (a collective under FSDP).
        ranked=False (the base model's validation at step 0): recorded, but no result of the run, so
        neither early stopping nor keepBest counts it.
        """
        metrics: dict[str, float] = {}
        with torch.random.fork_rng(devices=[]):
            batches = self._held_out_batches()
            was_training = model.training
            model.eval()
            try:
                if batches:
                    metrics = self.family.evaluate(model, batches)
                samples = self.is_main or self.sharded
                held_out = [batch for batch, _ in batches]
                images = []
                if samples:
                    with self.family.frozen_on_device():  # the pipeline's encoders, back off after
                        images = self.family.sample_images(model, held_out, self.draw)
            finally:
                model.train(was_training)
            if self.spec.clip_model:
                scores = self._clip_scores(images, held_out) if self.is_main else {}
                metrics = {**metrics, **self.from_main(lambda: scores)}
        self._record(step, metrics, images)
        if not ranked:
            return metrics
        monitored = metrics.get(self.spec.monitor)
        if monitored is not None and not math.isnan(monitored):
            if improves(monitored, self.best, self.spec.monitor):
                self.best, self.validations_without_improvement = monitored, 0
            else:
                self.validations_without_improvement += 1
            if self.spec.keep_best:
                state = trained_state()
                if self.is_main:
                    self._keep_best(step, monitored, lambda folder: self.family.save_weights(folder, state))
        return metrics

    def _clip_scores(self, images: list, held_out: list[dict]) -> dict[str, float]:
        if not images:
            if not self._said_nothing_to_score:
                log.warning("spec.validation.clipModel: no validation images to score; set spec.validation.prompts "
                            "(text-to-image families), or heldOutFraction > 0 with numSamples > 0")
                self._said_nothing_to_score = True
            return {}
        return self.family.image_metrics(images, held_out, self.draw, self.clip)

    @property
    def should_stop(self) -> bool:
        patience = self.spec.early_stopping_patience
        return patience is not None and self.validations_without_improvement >= patience

    def _record(self, step: int, metrics: dict[str, float], images: list) -> None:
        if not self.is_main:
            return
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.output / "logs"))
        for name, value in metrics.items():
            self._writer.add_scalar(f"validation/{name}", value, step)
        if metrics:
            log.info(TrainerLog.VALIDATION, step, TrainerLog.validation_metrics(metrics))
        folder = self.output / "samples" / f"step-{step:07d}"
        if images and isinstance(images[0], Clip):  # a video family's samples
            written = record_clips(images, folder, self._writer, step)
        elif images:
            import numpy as np

            folder.mkdir(parents=True, exist_ok=True)
            written = []
            for i, image in enumerate(images):
                image.save(folder / f"{i}.png")
                written.append(folder / f"{i}.png")
                self._writer.add_image(f"samples/{i}", np.asarray(image), step, dataformats="HWC")
            grid = image_grid(images)  # the same prompts and seed every time: one picture per step to compare
            grid.save(folder / "grid.png")
            written.append(folder / "grid.png")
            self._writer.add_image("samples/grid", np.asarray(grid), step, dataformats="HWC")
        self._writer.flush()
        if images:
            self.on_samples(step, written)

    def _keep_best(self, step: int, value: float, save_best: Callable[[Path], None]) -> None:
        """Save this step's weights under best/ if they rank among the K best; drop the rest."""
        root = self.output / "best"
        entries = [json.loads(p.read_text()) for p in root.glob("step-*/metric.json")] if root.is_dir() else []
        entries.append({"step": step, "value": value})
        ranked = sorted(entries, key=lambda e: e["value"], reverse=HIGHER_IS_BETTER[self.spec.monitor])
        kept = {e["step"] for e in ranked[:self.spec.keep_best]}
        if step in kept:
            folder = root / f"step-{step:07d}"
            save_best(folder)
            (folder / "metric.json").write_text(json.dumps({"step": step, "value": value,
                                                            "metric": self.spec.monitor}))
        for entry in entries:
            if entry["step"] not in kept:
                shutil.rmtree(root / f"step-{entry['step']:07d}", ignore_errors=True)

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.validations_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.validations_without_improvement = state["best"], state["bad"]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def ordered_batches(dataset, batch_size: int, collate) -> list[tuple[list, dict]]:
    """(keys, batch) for every sample of a keyed data set once, in order, batches of at most
    batch_size within a bucket: what validation evaluates and samples from."""
    keys = in_order(len(dataset), min(batch_size, len(dataset)), getattr(dataset, "groups", None))
    return list(zip(keys, DataLoader(dataset, batch_sampler=keys, collate_fn=collate)))


def image_grid(images: list, columns: int = 4):
    """The images side by side, COLUMNS to a row, each at the first one's size."""
    from PIL import Image

    width, height = images[0].size
    columns = min(columns, len(images))
    rows = -(-len(images) // columns)
    grid = Image.new("RGB", (columns * width, rows * height))
    for i, image in enumerate(images):
        grid.paste(image.convert("RGB").resize((width, height)), ((i % columns) * width, (i // columns) * height))
    return grid
