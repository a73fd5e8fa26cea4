"""`kubetune report` on a long run: how long the page takes, and how big it is.

    .venv/bin/python benchmarks/report.py                       # 10,000 steps, 50 validations, 3 rounds
    .venv/bin/python benchmarks/report.py --steps 1000 --validations 5 --rounds 1

Builds a synthetic run directory the way the trainer writes one: TensorBoard events from two writers
(the reporter's train/loss, train/lr and train/samples_per_second every step; the validator's
validation/loss and validation/clip_score, each sample image and the grid as image summaries, at every
validation), samples/step-NNNNNNN/{0..3,grid}.png at 512 px (four prompts: a 2048x512 grid), job.yaml,
run.json, 10 checkpoints with manifests and the final weights. Then times `kubetune report RUN --out
FILE` in a fresh process each round (what a user waits for, imports included) and, in this process,
the phases: reading the events, drawing the curves, embedding the grids. Medians are printed (a
benchmark, not a test: nothing is asserted).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

PROMPTS = ["a red circle on grass", "a blue square at night", "a green triangle in snow", "a yellow star"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--validations", type=int, default=50)
    parser.add_argument("--size", type=int, default=512, help="Sample image size in pixels.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="Build the run here and keep it.")
    return parser.parse_args(argv)


def sample_image(prompt: int, step: int, size: int) -> np.ndarray:
    """A smooth picture that drifts with the step (compresses like a generated image, unlike noise)."""
    y, x = np.mgrid[0:size, 0:size] / size
    phase = step / 1000.0
    channels = [np.sin(6 * x + prompt + phase) * 0.5 + 0.5, np.cos(5 * y - prompt + phase) * 0.5 + 0.5,
                ((x - 0.5) ** 2 + (y - 0.5) ** 2 < 0.1 + 0.02 * prompt) * 0.8]
    return (np.stack(channels, axis=-1) * 255).astype(np.uint8)


def build_run(root: Path, steps: int, validations: int, size: int) -> Path:
    from PIL import Image
    from torch.utils.tensorboard import SummaryWriter

    from kubetune_trainer.results.validation import image_grid

    run = root / "out" / "default" / "long" / "v0"
    (run / "logs").mkdir(parents=True)
    started = time.time() - steps * 1.5
    train = SummaryWriter(log_dir=str(run / "logs"))
    for step in range(1, steps + 1):
        wall = started + step * 1.5
        loss = 0.12 + 0.3 * math.exp(-step / 2000) + 0.02 * math.sin(step * 0.7)
        lr = 1e-4 * min(1.0, step / 500) * 0.5 * (1 + math.cos(math.pi * step / steps))
        train.add_scalar("train/loss", loss, step, walltime=wall)
        train.add_scalar("train/lr", lr, step, walltime=wall)
        train.add_scalar("train/samples_per_second", 5.3 + 0.1 * math.sin(step), step, walltime=wall)
    train.close()
    validator = SummaryWriter(log_dir=str(run / "logs"))
    every = max(1, steps // validations)
    for index in range(validations):
        step = index * every  # step 0: the base model
        validator.add_scalar("validation/loss", 0.2 + 0.1 * math.exp(-step / 3000), step)
        validator.add_scalar("validation/clip_score", 0.22 + 0.05 * (1 - math.exp(-step / 3000)), step)
        images = [Image.fromarray(sample_image(p, step, size)) for p in range(len(PROMPTS))]
        folder = run / "samples" / f"step-{step:07d}"
        folder.mkdir(parents=True)
        for i, image in enumerate(images):
            image.save(folder / f"{i}.png")
            validator.add_image(f"samples/{i}", np.asarray(image), step, dataformats="HWC")
        grid = image_grid(images)
        grid.save(folder / "grid.png")
        validator.add_image("samples/grid", np.asarray(grid), step, dataformats="HWC")
    validator.close()
    job = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "long"},
           "spec": {"model": {"family": "sd15", "pretrained": "s3://models/sd15"},
                    "data": {"layout": "captions", "uri": "s3://data/shapes"},
                    "training": {"maxSteps": steps, "batchSize": 8, "learningRate": 1e-4},
                    "validation": {"everySteps": every, "prompts": PROMPTS},
                    "checkpoints": {"uri": str(root / "out"), "everySteps": steps // 10}}}
    (run / "job.yaml").write_text(yaml.safe_dump(job))
    (run / "run.json").write_text(json.dumps({"runId": None, "steps": steps, "finished": True}))
    for step in range(steps // 10, steps + 1, steps // 10):
        folder = run / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "adapter.safetensors").write_bytes(b"\0" * 4096)
        (folder / "manifest.json").write_text(json.dumps({
            "step": step, "epoch": step // 1000, "loss": 0.13, "time": started + step * 1.5,
            "files": {"adapter.safetensors": {"size": 4096, "sha256": "0" * 64}}}))
    (run / "pytorch_lora_weights.safetensors").write_bytes(b"\0" * 4096)
    return run


def time_phases(run: Path) -> dict[str, float]:
    from kubetune_trainer.results.run_report import charts, page
    from kubetune_trainer.results.run_report.facts import grids_in
    from kubetune_trainer.results.run_report.events import read_scalars

    started = time.perf_counter()
    scalars = read_scalars(run / "logs")
    read = time.perf_counter()
    charts.training_curves(scalars.get("train/loss"), scalars.get("train/lr"))
    charts.validation_curves(scalars.under("validation/"))
    drawn = time.perf_counter()
    page.embedded_grids(grids_in(run / "samples"))
    embedded = time.perf_counter()
    return {"read events": read - started, "draw curves": drawn - read, "embed grids": embedded - drawn}


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kubetune-report-bench-") as scratch:
        root = args.keep or Path(scratch)
        began = time.perf_counter()
        run = build_run(root, args.steps, args.validations, args.size)
        logs = sum(p.stat().st_size for p in (run / "logs").iterdir())
        print(f"synthetic run: {args.steps} steps, {args.validations} validations of {len(PROMPTS)} {args.size} px "
              f"images, {logs / 2**20:.1f} MiB of events, built in {time.perf_counter() - began:.1f} s: {run}")
        command = [sys.executable, "-m", "kubetune_cli.main", "report", str(run), "--out", str(root / "report.html"),
                   "--force"]
        print("$", " ".join(command))
        walls, phases = [], []
        for round_ in range(1, args.rounds + 1):
            began = time.perf_counter()
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
            walls.append(time.perf_counter() - began)
            phases.append(time_phases(run))
            print(f"round {round_}: kubetune report {walls[-1]:.2f} s; "
                  + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases[-1].items()))
        size = (root / "report.html").stat().st_size
        print(f"median of {args.rounds}: kubetune report {statistics.median(walls):.2f} s, page {size / 2**20:.1f} MiB; "
              + ", ".join(f"{name} {statistics.median(p[name] for p in phases):.2f} s" for name in phases[0]))


if __name__ == "__main__":
    main()
