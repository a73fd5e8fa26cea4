"""Seconds per generated image, per family, through kubetune_trainer.results.generation (what `kubetune generate`
and every validation's samples cost).

    .venv/bin/python benchmarks/generate.py                          # every image family's tiny model, CPU
    .venv/bin/python benchmarks/generate.py --family sd15 --family pmg
    python3 benchmarks/generate.py --full-size --family sd15 --device cuda --steps 20   # real architecture, GPU
    .venv/bin/python benchmarks/generate.py --tiny-configs --family sd15 --steps 2     # that path, on the CPU

Each family's tiny model (or, with --full-size, its real architecture from configs with random
weights built on the device: kubetune_trainer.models.random_weights, as gpu_lora_step.py does) and generated data
at the resolution; a LoRA job on it; the base model loaded once (Generator), one warm-up draw, then
--repeats draws of --images images each with --steps denoising steps. Edit families edit the
generated control images, PMG draws for its held-out users, the others draw from prompts. Prints one
line per family: load seconds and seconds per image (the median draw over its images). Not a test:
nothing is asserted. Results go into benchmarks/RESULTS.md with the command and the device.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kubetune_api.families import FAMILIES, LORA_ALPHA, LORA_RANK


def image_families() -> list[str]:
    return [name for name, row in FAMILIES.items() if {"clip_score", "clip_directional"} & set(row.metrics)]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=image_families(),
                        help="repeatable (default: every family that draws images)")
    parser.add_argument("--full-size", action="store_true", help="the real architecture with random weights")
    parser.add_argument("--tiny-configs", action="store_true", help="the tiny model's configs, its weights built "
                        "as --full-size builds them (checks that path on any device)")
    parser.add_argument("--resolution", type=int, help="default: 32 (tiny), the family's native side (--full-size)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per image")
    parser.add_argument("--images", type=int, default=2, help="images per draw")
    parser.add_argument("--repeats", type=int, default=3, help="timed draws after the warm-up")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", type=Path, help="keep models and data here (default: a temporary directory)")
    return parser.parse_args(argv)


def job(family: str, model: Path, data: Path, resolution: int, images: int, device: str):
    from kubetune_api.spec import TrainingJob

    honours = FAMILIES[family].honours
    adapter = {"type": "lora", **({"rank": 16} if LORA_RANK in honours else {}),
               **({"alpha": 16} if LORA_ALPHA in honours else {})}
    return TrainingJob.model_validate({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "generate-bench"},
        "spec": {"model": {"family": family, "pretrained": str(model)}, "adapter": adapter,
                 "data": {"layout": FAMILIES[family].layouts[0], "uri": str(data), "resolution": resolution},
                 "training": {"batchSize": images, "maxSteps": 1},
                 "validation": {"numSamples": images}, "checkpoints": {"uri": str(data.parent / "out")},
                 "resources": {"gpusPerNode": 1 if device.startswith("cuda") else 0}},
    })



def request_for(family: str, data: Path, images: int, steps: int):
    from kubetune_api.data_layouts import DATA_LAYOUTS
    from kubetune_trainer.results.generation import Request

    layout = FAMILIES[family].layouts[0]
    if DATA_LAYOUTS[layout].edits:  # the generated pairs' control images, each with an instruction
        controls = tuple(sorted((data / "control_images").iterdir())[:images])
        return Request(prompts=("make it blue",) * len(controls), controls=controls, steps=steps, seed=0)
    if layout == "pmg":  # its held-out users (their histories), as `kubetune generate` draws without --prompt
        return Request(steps=steps, seed=0, count=images)
    return Request(prompts=("a red circle on a white background",) * images, steps=steps, seed=0)


def measure(family: str, args, workdir: Path) -> tuple[float, float]:
    from kubetune_trainer.models.reference_models import write_config_only
    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    row = FAMILIES[family]
    resolution = args.resolution or ((row.native_resolution or row.profile.image_size) if args.full_size else 32)
    model = workdir / f"{family}-{'full-configs' if args.full_size else 'tiny-configs' if args.tiny_configs else 'tiny'}"
    if not model.exists():
        (write_config_only if args.full_size else write_tiny_model)(family, model)
        if args.tiny_configs:
            from gpu_lora_step import drop_weights

            drop_weights(model)
    layout = row.layouts[0]
    data = workdir / f"{layout}-{resolution}"
    if not data.exists():
        write_tiny_data(layout, data, count=max(8, 2 * args.images), size=resolution)
    building = contextlib.nullcontext()
    if args.full_size or args.tiny_configs:  # every from_pretrained of a config-only folder builds the model
        from kubetune_trainer.models.random_weights import built_from_configs

        building = built_from_configs(args.device)
    with building:
        return timed(family, args, model, data, resolution)


def timed(family: str, args, model: Path, data: Path, resolution: int) -> tuple[float, float]:
    import torch

    from kubetune_trainer.results.generation import Generator

    started = time.perf_counter()
    generator = Generator(job(family, model, data, resolution, args.images, args.device), args.device)
    loaded = time.perf_counter() - started
    request = request_for(family, data, args.images, args.steps)
    generator.generate(request)  # warm-up: kernels, the pipeline's first build
    times = []
    for _ in range(args.repeats):
        if torch.cuda.is_available() and args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        drawn = generator.generate(request)
        if torch.cuda.is_available() and args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) / len(drawn))
    del generator
    return loaded, statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    families = args.family or image_families()
    sys.path.insert(0, str(Path(__file__).parent))  # gpu_lora_step's drop_weights
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"{'family':22} {'load s':>8} {'s/image':>9}  ({args.steps} steps, {args.images} images a draw, "
              f"{'full size' if args.full_size else 'tiny, built from configs' if args.tiny_configs else 'tiny'}, "
              f"{args.device})")
        for family in families:
            loaded, per_image = measure(family, args, workdir)
            print(f"{family:22} {loaded:8.2f} {per_image:9.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
