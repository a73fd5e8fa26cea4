"""What the embedding cache saves with augmentation on: real-architecture VAE and text encoders.

    .venv/bin/python benchmarks/cache_gain.py                      # sd15 and sdxl, 256 px, CPU
    .venv/bin/python benchmarks/cache_gain.py --families sd15 --resolution 512

For each family, a model folder holds the real VAE and text encoder(s) with random weights (SD1.5:
VAE + CLIP ViT-L/14; SDXL: VAE + CLIP ViT-L/14 + OpenCLIP ViT-bigG/14) and a toy UNet of the
matching conditioning width, so the step is what the cache can remove: encoding images and
captions. The data are wider than tall (random crops have room), trained with randomFlip,
random crops and caption dropout. Uncached: the encoders run every step. Cached: `kubetune train
--cache-only` fills the cache first (each image with its mirror, each caption with its dropped
form), then training reads it; the trainer's per-epoch line gives the hit rate. Steady samples/s
from TensorBoard step times after warm-up. A benchmark, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


# What a toy UNet keeps of the reference one: how it is conditioned.
CONDITIONING = ("cross_attention_dim", "use_linear_projection", "addition_embed_type", "addition_time_embed_dim",
                "projection_class_embeddings_input_dim")


def unet_families() -> list[str]:
    """The families that train a UNet on captions (their declarations say so): sd15 and sdxl."""
    from kubetune_api.families import FAMILIES
    from kubetune_trainer.families import definitions

    return [name for name, definition in definitions().items()
            if definition.trained == "unet" and "captions" in FAMILIES[name].layouts]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    families = unet_families()
    parser.add_argument("--families", nargs="+", default=families, choices=families)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3, help="the first is warm-up for the timing")
    parser.add_argument("--workdir", type=Path, help="keep models and data here (default: a temporary directory)")
    return parser.parse_args(argv)


def toy_unet(reference: dict):
    """The family's reference UNet conditioned as it is (CONDITIONING) at toy width: two levels, its
    first and last block types, of 32 and 64 channels."""
    from diffusers import UNet2DConditionModel

    heads = reference["attention_head_dim"]
    return UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        norm_num_groups=32, down_block_types=(reference["down_block_types"][0], reference["down_block_types"][-1]),
        up_block_types=(reference["up_block_types"][0], reference["up_block_types"][-1]),
        attention_head_dim=heads if isinstance(heads, int) else (2, 4),
        **{key: reference[key] for key in CONDITIONING if key in reference})


def write_model(family: str, out: Path) -> Path:
    """Real VAE and text encoders with random weights, a toy UNet conditioned like the real one."""
    import torch

    from kubetune_trainer.families.components import build

    from kubetune_trainer.models.reference_models import architecture, write_config_only

    if (out / "unet" / "diffusion_pytorch_model.safetensors").exists():
        return out
    write_config_only(family, out)
    torch.manual_seed(0)
    components = architecture(family)
    for name, component in components.items():
        if name != "unet":
            build(component).save_pretrained(out / component.subfolder, safe_serialization=True)
    toy_unet(components["unet"].config).save_pretrained(out / "unet", safe_serialization=True)
    return out


def write_data(out: Path, count: int, resolution: int) -> Path:
    from PIL import Image

    from kubetune_trainer.data.tiny_data import write_tiny_data

    if (out / "metadata.jsonl").exists():
        return out
    write_tiny_data("captions", out, count=count, size=resolution, seed=0)
    for image in out.glob("*.png"):  # 5:4: a random crop has room to move
        Image.open(image).resize((resolution * 5 // 4, resolution)).save(image)
    return out


def run(args, family: str, model: Path, data: Path, out: Path, cached: bool) -> tuple[float, str]:
    """(steady samples/s, the trainer's log) for one training run."""
    shutil.rmtree(out, ignore_errors=True)
    manifest = {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "cache-bench"},
        "spec": {
            "model": {"family": family, "pretrained": str(model)},
            "adapter": {"type": "lora", "rank": 4},
            "data": {"layout": "captions", "uri": str(data), "resolution": args.resolution, "randomFlip": True,
                     "centerCrop": False, "captionDropout": 0.1,
                     "cache": {"enabled": cached, "uri": str(out / "cache")}},
            "training": {"epochs": args.epochs, "batchSize": args.batch_size, "learningRate": 1e-4},
            "checkpoints": {"uri": str(out / "runs"), "everySteps": 10_000_000},
            "resources": {"gpusPerNode": 0},
        },
    }
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(manifest))
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    command = [sys.executable, "-m", "kubetune_trainer", "--config", str(config)]
    if cached:
        subprocess.run([*command, "--cache-only"], env=env, check=True, capture_output=True)
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{family} {'cached' if cached else 'uncached'} failed:\n{result.stderr[-3000:]}")
    return steady_rate(out / "runs" / "default" / "cache-bench" / "v0" / "logs", args), result.stderr


def steady_rate(log_dir: Path, args) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    times = [e.wall_time for e in sorted(events.Scalars("train/loss"), key=lambda e: e.step)]
    warmup = len(times) // args.epochs  # the first epoch
    measured = times[warmup - 1:]
    return args.batch_size / statistics.median(b - a for a, b in zip(measured, measured[1:]))


def main(argv=None) -> None:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kubetune-cache-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    data = write_data(workdir / f"data-{args.resolution}", args.images, args.resolution)
    print(f"real VAE + text encoders (random weights), toy UNet, {args.resolution} px, batch {args.batch_size}, "
          f"randomFlip + random crop + captionDropout 0.1, {args.epochs} epochs of {args.images} images, CPU")
    print("| family | uncached samples/s | cached samples/s | ratio | cache hits after the cache stage |")
    print("|---|---|---|---|---|")
    for family in args.families:
        model = write_model(family, workdir / f"{family}-encoders")
        plain, _ = run(args, family, model, data, workdir / f"{family}-plain", cached=False)
        cached, log = run(args, family, model, data, workdir / f"{family}-cached", cached=True)
        rates = re.findall(r"embedding cache \d+ hits, \d+ misses \(([\d.]+)% hits\)", log)
        print(f"| {family} | {plain:.2f} | {cached:.2f} | {cached / plain:.1f}x | {', '.join(rates)}% per epoch |",
              flush=True)


if __name__ == "__main__":
    main()
