"""Trainer throughput: kubetune's SD1.5 LoRA trainer against a plain diffusers + peft loop.

    .venv/bin/python benchmarks/trainer_throughput.py            # CPU: the tiny model
    .venv/bin/python benchmarks/trainer_throughput.py --full-size  # GPU: real SD1.5 architecture
    .venv/bin/python benchmarks/trainer_throughput.py --families   # every family, with and without the cache

Both sides train the same random-weight model on the same generated data with the same batch,
resolution, precision, LoRA rank and optimizer, each in a fresh process. The baseline is written
the way the diffusers LoRA text-to-image example is: Accelerate-prepared UNet, optimizer,
dataloader and scheduler, `accelerator.accumulate`, VAE and text encoder run every step.
Throughput is steady-state samples/s over the steps after the warm-up; the figures and their
ratio are printed (a benchmark, not a test: nothing is asserted).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-size", action="store_true",
                        help="real SD1.5 architecture (random weights), GPU: bf16, 512 px, batch 8")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--resolution", type=int)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="measured steps after warm-up")
    parser.add_argument("--workdir", type=Path, help="keep the model and data here (default: a temp dir)")
    parser.add_argument("--families", action="store_true",
                        help="kubetune only: every family's tiny model, uncached and with a filled embedding cache")
    parser.add_argument("--variants", default="plain",
                        help="kubetune runs, comma-separated: plain; cached (embedding cache filled first); "
                             "compiled (cached + spec.training.compile); reduce-overhead (cached + CUDA graphs)")
    parser.add_argument("--baseline-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {"batch_size": 8, "resolution": 512, "mixed_precision": "bf16"} if args.full_size \
        else {"batch_size": 8, "resolution": 32, "mixed_precision": "no"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def prepare_inputs(args, workdir: Path) -> tuple[Path, Path]:
    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    model = workdir / ("sd15-full" if args.full_size else "sd15-tiny")
    if not (model / "model_index.json").exists():
        write_tiny_model("sd15", model, full_size=args.full_size)
    data = workdir / f"captions-{args.resolution}"
    if not (data / "metadata.jsonl").exists():
        write_tiny_data("captions", data, count=args.batch_size * 4, size=args.resolution)
    return model, data


def settings(args, model: Path, data: Path, out: Path) -> dict:
    return {
        "model": str(model), "data": str(data), "out": str(out), "batch_size": args.batch_size,
        "resolution": args.resolution, "mixed_precision": args.mixed_precision, "rank": args.rank,
        "total_steps": args.warmup_steps + args.steps, "warmup_steps": args.warmup_steps,
        "gpus": 1 if args.full_size else 0,
    }


# --- kubetune: the real trainer, in its own process, timed from its TensorBoard events ---------

# What each --variants name changes in kubetune's run: (embedding cache, spec.training fields).
VARIANTS = {"plain": (False, {}), "cached": (True, {}), "compiled": (True, {"compile": True}),
            "reduce-overhead": (True, {"compile": True, "compileMode": "reduce-overhead"})}


def run_kubetune(cfg: dict, variant: str = "plain") -> float:
    cached, training = VARIANTS[variant]
    manifest = {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "bench"},
        "spec": {
            "model": {"family": "sd15", "pretrained": cfg["model"]},
            "adapter": {"type": "lora", "rank": cfg["rank"], "alpha": cfg["rank"]},
            "data": {"layout": "captions", "uri": cfg["data"], "resolution": cfg["resolution"],
                     "cache": {"enabled": cached, "uri": f"{cfg['out']}-cache"}},
            "training": {"maxSteps": cfg["total_steps"], "batchSize": cfg["batch_size"], "learningRate": 1e-4,
                         "mixedPrecision": cfg["mixed_precision"], "maxGradNorm": 1.0, **training},
            "checkpoints": {"uri": cfg["out"], "everySteps": 10_000_000, "keepLast": 1},
            "resources": {"gpusPerNode": cfg["gpus"]},
        },
    }
    config = Path(cfg["out"]).with_suffix(".yaml")
    config.write_text(yaml.safe_dump(manifest))
    command = [sys.executable, "-m", "kubetune_trainer", "--config", str(config)]
    for extra in ([["--cache-only"]] if cached else []) + [[]]:
        result = subprocess.run(command + extra, capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"kubetune trainer ({variant}) failed:\n{result.stderr[-4000:]}")
    return steady_rate(step_times_from_events(newest_run(Path(cfg["out"])) / "logs"), cfg)


def newest_run(checkpoints_uri: Path) -> Path:
    """The run directory the trainer just wrote: <uri>/default/bench/v<highest N>."""
    from kubetune_api import layout

    runs = (checkpoints_uri / "default" / "bench").glob("v*")
    return max(runs, key=lambda p: layout.parse_version(p.name) or -1)


def step_times_from_events(log_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    return [e.wall_time for e in sorted(events.Scalars("train/loss"), key=lambda e: e.step)]


def steady_rate(step_end_times: list[float], cfg: dict) -> float:
    """Samples/s between the end of the warm-up and the end of the last step."""
    measured = step_end_times[cfg["warmup_steps"] - 1:]
    return (len(measured) - 1) * cfg["batch_size"] / (measured[-1] - measured[0])


# --- every family, with and without the embedding cache ------------------------------------------

def family_adapter(family: str, rank: int) -> dict:
    """LoRA of `rank` where the family's row honours a LoRA shape (PMG trains parts of its own)."""
    from kubetune_api.families import FAMILIES, LORA_ALPHA, LORA_RANK

    honours = FAMILIES[family].honours
    return {"type": "lora", **({"rank": rank} if LORA_RANK in honours else {}),
            **({"alpha": rank} if LORA_ALPHA in honours else {})}


def run_family(args, family: str, layout: str, workdir: Path, cached: bool) -> float:
    """Steady-state samples/s of one family's tiny model; `cached` fills the cache first (--cache-only)."""
    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    model, data = workdir / f"model-{family}", workdir / f"data-{layout}"
    if not model.exists():
        write_tiny_model(family, model)
    if not data.exists():
        write_tiny_data(layout, data, count=args.batch_size * 4, size=args.resolution)
    out = workdir / f"run-{family}-{'cached' if cached else 'plain'}"
    manifest = {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "bench"},
        "spec": {
            "model": {"family": family, "pretrained": str(model)},
            "adapter": family_adapter(family, args.rank),
            "data": {"layout": layout, "uri": str(data), "resolution": args.resolution,
                     **({"cache": {"enabled": True, "uri": str(out / "cache")}} if cached else {})},
            "training": {"maxSteps": args.warmup_steps + args.steps, "batchSize": args.batch_size,
                         "learningRate": 1e-4, "mixedPrecision": args.mixed_precision},
            "checkpoints": {"uri": str(out), "everySteps": 10_000_000, "keepLast": 1},
            "resources": {"gpusPerNode": 1 if args.full_size else 0},
        },
    }
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(manifest))
    command = [sys.executable, "-m", "kubetune_trainer", "--config", str(config)]
    for extra in ([["--cache-only"]] if cached else []) + [[]]:
        result = subprocess.run(command + list(extra), capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"{family} failed:\n{result.stderr[-4000:]}")
    cfg = {"warmup_steps": args.warmup_steps, "batch_size": args.batch_size}
    return steady_rate(step_times_from_events(newest_run(out) / "logs"), cfg)


def benchmark_families(args, workdir: Path) -> None:
    from kubetune_api.families import EMBEDDING_CACHE, FAMILIES

    print(f"every family, tiny models, LoRA r{args.rank}, batch {args.batch_size}, {args.resolution} px, "
          f"precision {args.mixed_precision}, {args.steps} steps after {args.warmup_steps} warm-up")
    print(f"{'family':16s} {'uncached':>10s} {'cached':>10s}  samples/s")
    for family, row in FAMILIES.items():
        layout = row.layouts[0]
        try:
            plain = run_family(args, family, layout, workdir, cached=False)
            # A family without frozen encoders (the classifier) has no embedding cache to fill.
            cached = run_family(args, family, layout, workdir, cached=True) if EMBEDDING_CACHE in row.honours else None
        except ValueError as err:  # no tiny model for the family in this version
            print(f"{family:16s} skipped: {err}")
            continue
        print(f"{family:16s} {plain:10.2f} {f'{cached:10.2f}' if cached is not None else 'n/a':>10s}")


# --- baseline: a plain loop in the style of the diffusers LoRA example --------------------------

def run_baseline(cfg: dict) -> float:
    path = Path(cfg["out"]).with_suffix(".baseline.json")
    path.write_text(json.dumps(cfg))
    result = subprocess.run([sys.executable, str(HERE), "--baseline-worker", str(path)], check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["samples_per_second"]


def baseline_worker(cfg: dict) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS

    accelerator = Accelerator(mixed_precision=cfg["mixed_precision"], cpu=cfg["gpus"] == 0)
    torch.manual_seed(0)
    noise_scheduler = DDPMScheduler.from_pretrained(cfg["model"], subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(cfg["model"], subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(cfg["model"], subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(cfg["model"], subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(cfg["model"], subfolder="unet")
    for module in (unet, vae, text_encoder):
        module.requires_grad_(False)
    weight_dtype = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg["mixed_precision"]]
    unet.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    unet.add_adapter(LoraConfig(r=cfg["rank"], lora_alpha=cfg["rank"], init_lora_weights="gaussian",
                                target_modules=DIFFUSERS_ATTENTION_TARGETS))
    if weight_dtype != torch.float32:
        cast_training_params(unet, dtype=torch.float32)
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    size = cfg["resolution"]
    records = [json.loads(line) for line in (Path(cfg["data"]) / "metadata.jsonl").read_text().splitlines()]

    def load(record):
        image = Image.open(Path(cfg["data"]) / record["file_name"]).convert("RGB").resize((size, size))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
        ids = tokenizer(record["text"], max_length=tokenizer.model_max_length, padding="max_length",
                        truncation=True, return_tensors="pt").input_ids[0]
        return {"pixel_values": pixels, "input_ids": ids}

    def collate(items):
        return {"pixel_values": torch.stack([i["pixel_values"] for i in items]).contiguous().float(),
                "input_ids": torch.stack([i["input_ids"] for i in items])}

    class LazyImages(torch.utils.data.Dataset):
        """Decoded and tokenized per item, as the example's with_transform(preprocess_train) does."""

        def __len__(self):
            return len(records)

        def __getitem__(self, index):
            return load(records[index])

    dataloader = torch.utils.data.DataLoader(LazyImages(), shuffle=True,
                                             batch_size=cfg["batch_size"], collate_fn=collate, drop_last=True)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    unet, optimizer, dataloader, lr_scheduler = accelerator.prepare(unet, optimizer, dataloader, lr_scheduler)

    step_end_times: list[float] = []
    unet.train()
    while len(step_end_times) < cfg["total_steps"]:
        for batch in dataloader:
            with accelerator.accumulate(unet):
                latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                          device=latents.device).long()
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
                loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            loss.detach().item()  # the example logs the loss every step, which synchronises too
            step_end_times.append(time.time())
            if len(step_end_times) == cfg["total_steps"]:
                break
    print(json.dumps({"samples_per_second": steady_rate(step_end_times, cfg)}))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.baseline_worker:
        baseline_worker(json.loads(args.baseline_worker.read_text()))
        return
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="kubetune-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.families:
            benchmark_families(args, workdir)
            return
        model, data = prepare_inputs(args, workdir)
        import torch

        device = torch.cuda.get_device_name() if args.full_size and torch.cuda.is_available() else "cpu"
        print(f"SD1.5 LoRA r{args.rank}, {'full-size' if args.full_size else 'tiny'} model, batch "
              f"{args.batch_size}, {args.resolution} px, precision {args.mixed_precision}, device {device}, "
              f"{args.steps} steps after {args.warmup_steps} warm-up")
        baseline = run_baseline(settings(args, model, data, Path(tmp) / "baseline"))
        print(f"diffusers+peft loop   {baseline:10.2f} samples/s", flush=True)
        for variant in args.variants.split(","):
            ours = run_kubetune(settings(args, model, data, Path(tmp) / f"kubetune-{variant}"), variant)
            print(f"kubetune {variant:16s} {ours:10.2f} samples/s, ratio to the loop {ours / baseline:6.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
