"""LoRA training speed and memory of a real architecture on one GPU: one command per family.

    .venv/bin/python benchmarks/gpu_lora_step.py --family sd15           # SD1.5, 512 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family sdxl           # SDXL, 1024 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family flux-kontext   # FLUX.1 Kontext, 1024 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family qwen-image-edit
    .venv/bin/python benchmarks/gpu_lora_step.py --family z-image        # Z-Image 6B + Qwen3-4B, 1024 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family sd35           # SD 3.5 large 8B + CLIP-L/G + T5-XXL
    .venv/bin/python benchmarks/gpu_lora_step.py --family qwen-image     # 20B + Qwen2.5-VL-7B, 1024 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family qwen-image-edit-plus   # the same, one reference per pair
    .venv/bin/python benchmarks/gpu_lora_step.py --family flux2-klein    # FLUX.2 [klein] 4B + Qwen3-4B, 1024 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family flux2 --cache --quantization fp8
                                            # FLUX.2 [dev] 32B (fp8) from the cache; Mistral 24B in CPU memory
    .venv/bin/python benchmarks/gpu_lora_step.py --family wan            # one Wan 14B expert + UMT5-XXL, 480 px, 1 frame
    .venv/bin/python benchmarks/gpu_lora_step.py --family wan --frames 81 --resolution 832,480 --gradient-checkpointing
    .venv/bin/python benchmarks/gpu_lora_step.py --family pmg            # LLaMA-2-7B + SD1.5, 512 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family classifier     # ViT-B/16, 224 px
    .venv/bin/python benchmarks/gpu_lora_step.py --family sd15 --tiny --device cpu   # the plumbing, anywhere

Writes the family's configs only (reference_models.write_config_only: no weight file, so FLUX.2
[dev]'s ~112 GB and Qwen-Image's ~58 GB need no disk) and generated data at the resolution, then
runs the real trainer through kubetune_trainer.models.random_weights, which builds each model from its
configs with random weights on the GPU (speed and memory do not depend on the values) and hands
it to the trainer as from_pretrained would (one GPU, bf16, LoRA rank 16, batch 1, no embedding
cache, so the text encoders and VAE run every step), and prints seconds per step after the
warm-up, the peak GPU memory the trainer reports, and `kubetune plan`'s estimate of that peak.
`--tiny` does the same with the tiny model's configs (its weights removed), on any device.
`--cache` fills the embedding cache first and trains from it; `--compile MODE` sets
spec.training.compile; `--quantization fp8` quantizes the transformer after it is built.
Not a test: nothing is asserted. Results go into
benchmarks/RESULTS.md with the device (`nvidia-smi -L`).
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from kubetune_api.families import FAMILIES, LORA_ALPHA, LORA_RANK
from kubetune_api.spec_data import VIDEO_LAYOUTS


def layout(args) -> str:
    """The family's first layout; with --frames, its video layout."""
    layouts = FAMILIES[args.family].layouts
    return next(name for name in layouts if name in VIDEO_LAYOUTS) if args.frames else layouts[0]


def resolution(text: str) -> int | list[int]:
    """A side (512) or WIDTH,HEIGHT (832,480), as spec.data.resolution takes them."""
    sides = [int(side) for side in text.split(",")]
    if len(sides) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r}: give one side or WIDTH,HEIGHT")
    return sides[0] if len(sides) == 1 else sides


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--resolution", type=resolution,
                        help="a side or WIDTH,HEIGHT (default: the family's native side, from the families table)")
    parser.add_argument("--frames", type=int, help="frames per sample: train on generated video clips (the "
                        "family's video layout, e.g. wan: 81)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--cache", action="store_true",
                        help="fill the embedding cache first (--cache-only), then train from it (encoders idle)")
    parser.add_argument("--quantization", choices=["fp8"], help="spec.model.quantization (nf4 loads "
                        "quantized weights from files, which a built model has not)")
    parser.add_argument("--compile", choices=["default", "max-autotune-no-cudagraphs", "reduce-overhead"],
                        help="spec.training.compile with this compileMode")
    parser.add_argument("--steps", type=int, default=10, help="measured steps after the warm-up")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the family's tiny model (a quick check of the command)")
    parser.add_argument("--workdir", type=Path, help="keep the model and data here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.frames and not any(name in VIDEO_LAYOUTS for name in FAMILIES[args.family].layouts):
        parser.error(f"--frames: family {args.family} trains on no video layout")
    row = FAMILIES[args.family]  # a family without a native resolution: its reference model's own size
    native = row.native_resolution or row.profile.image_size
    args.resolution = args.resolution or (32 if args.tiny else native)
    return args


def require_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_lora_step.py needs a CUDA GPU (this process sees none); "
                 "--tiny --device cpu checks the command itself")


def drop_weights(folder: Path) -> None:
    """Leave a written model's configs, tokenizers and scheduler: its weights are built at start."""
    from kubetune_trainer.models.random_weights import WEIGHT_SUFFIXES

    for path in folder.rglob("*"):
        if path.suffix in WEIGHT_SUFFIXES or path.name.endswith(".index.json"):
            path.unlink()


def prepare(args, workdir: Path) -> tuple[Path, Path]:
    from kubetune_trainer.models.reference_models import write_config_only
    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    model = workdir / f"{args.family}-{'tiny' if args.tiny else 'full'}-configs"
    if not model.exists():
        if args.tiny:
            write_tiny_model(args.family, model)
            drop_weights(model)
        else:
            write_config_only(args.family, model)
    side = max(args.resolution) if isinstance(args.resolution, list) else args.resolution  # cropped to size
    data = workdir / f"{layout(args)}-{side}{f'-{args.frames}f' if args.frames else ''}"
    if not data.exists():
        clips = {"frames": args.frames} if args.frames else {}
        write_tiny_data(layout(args), data, count=4 * args.batch_size, size=side, **clips)
    return model, data


def lora_adapter(family: str, rank: int) -> dict:
    """LoRA of `rank`; PMG's adapter is its soft prompts, prefix and mapping layer (no rank)."""
    honours = FAMILIES[family].honours
    return {"type": "lora", **({"rank": rank} if LORA_RANK in honours else {}),
            **({"alpha": rank} if LORA_ALPHA in honours else {})}


def manifest(args, model: Path, data: Path, out: Path) -> dict:
    return {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "gpu-bench"},
        "spec": {
            "model": {"family": args.family, "pretrained": str(model),
                      **({"quantization": args.quantization} if args.quantization else {})},
            "adapter": lora_adapter(args.family, args.rank),
            "data": {"layout": layout(args), "uri": str(data), "resolution": args.resolution,
                     **({"frames": args.frames} if args.frames else {}),
                     **({"cache": {"enabled": True, "uri": str(out / "cache")}} if args.cache else {})},
            "training": {"maxSteps": args.warmup_steps + args.steps, "batchSize": args.batch_size,
                         "learningRate": 1e-4, "mixedPrecision": "bf16",
                         "gradientCheckpointing": args.gradient_checkpointing,
                         **({"compile": True, "compileMode": args.compile} if args.compile else {})},
            "checkpoints": {"uri": str(out), "everySteps": 10_000_000, "keepLast": 1},
            "resources": {"gpusPerNode": 1 if args.device == "cuda" else 0},
        },
    }


def seconds_per_step(log_dir: Path, warmup: int) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    times = [e.wall_time for e in sorted(events.Scalars("train/loss"), key=lambda e: e.step)][warmup - 1:]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def planned_peak_gib(job: dict, device: str) -> float | None:
    """kubetune plan's estimate of the same job (None where it cannot build the architecture)."""
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.planning import Planner

    try:
        return Planner(device).estimate(parse_manifest(job).spec, 1, "ddp").total / 2**30
    except Exception as err:  # noqa: BLE001 - the benchmark's figure matters more than the estimate
        print(f"(no plan estimate: {err})", file=sys.stderr)
        return None


def main(argv=None) -> None:
    args = parse_args(argv)
    require_device(args.device)
    with tempfile.TemporaryDirectory(prefix="kubetune-gpu-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        model, data = prepare(args, workdir)
        out = workdir / "runs"
        job = manifest(args, model, data, out)
        config = workdir / "job.yaml"
        config.write_text(yaml.safe_dump(job))
        command = [sys.executable, "-m", "kubetune_trainer.models.random_weights", "--build-device", args.device,
                   "--config", str(config)]
        for extra in ([["--cache-only"]] if args.cache else []) + [[]]:
            result = subprocess.run(command + extra, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"the trainer failed:\n{result.stderr[-4000:]}")
        compiled = re.search(r"torch.compile: .*", result.stderr)
        built = re.findall(r"random weights \(a benchmark stand-in for .*", result.stderr)
        runs = sorted((out / "default" / "gpu-bench").glob("v*"), key=lambda p: int(p.name[1:]))
        step = seconds_per_step(runs[-1] / "logs", args.warmup_steps)
        peak = re.search(r"peak GPU memory on rank 0: ([\d.]+) GiB allocated", result.stderr)
        plan = planned_peak_gib(job, args.device)
    size = "tiny" if args.tiny else "real architecture, random weights"
    adapter = f"LoRA r{args.rank}" if "rank" in job["spec"]["adapter"] else "adapter (soft prompts, prefix, mapping)"
    frames = f", {args.frames} frames" if args.frames else ""
    print(f"{args.family} {adapter}, {size}, {args.resolution} px{frames}, batch {args.batch_size}, bf16, "
          f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
          f"embedding cache {'filled first' if args.cache else 'off'}, compile {args.compile or 'off'}, "
          f"quantization {args.quantization or 'none'}, "
          f"device {args.device}")
    for line in built:
        print(f"  {line}")
    if compiled:
        print(f"  {compiled.group(0)}")
    print(f"  seconds per step        {step:.3f}   ({args.batch_size / step:.2f} samples/s)")
    print(f"  peak GPU memory         {peak.group(1) + ' GiB' if peak else 'n/a (not a GPU)'}")
    print(f"  kubetune plan estimate  {f'{plan:.2f} GiB' if plan is not None else 'n/a'}")


if __name__ == "__main__":
    main()
