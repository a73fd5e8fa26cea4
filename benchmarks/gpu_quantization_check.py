"""GPU check: fp8 and nf4 quantized bases and the adamw8bit optimizer train a LoRA, with their memory and speed.

    .venv/bin/python benchmarks/gpu_quantization_check.py            # full-size SD1.5 UNet (random weights), 512 px
    .venv/bin/python benchmarks/gpu_quantization_check.py --tiny     # the tiny SD1.5: a minute, for a quick look

Needs a CUDA GPU (fp8: compute capability 8.9+; on an older GPU fp8 must be refused, and that is checked).
Two parts, each variant in a fresh process so that peak memory is its own:
1. The trainer's building blocks on the SD1.5 UNet (quantization.load_kwargs / apply_after_load,
   families.lora.attach_lora, optim.build_optimizer), LoRA steps on random latents and text
   embeddings (speed does not depend on the data) under bf16 autocast. Checked: the option took
   effect (float8 weights, 4-bit layers, 8-bit optimizer state), the loss is finite, the LoRA moved,
   the frozen base did not, and a quantized base takes less memory than bf16. Printed: weight memory,
   peak memory, s/step.
2. The trainer itself (`python -m kubetune_trainer`, what the image runs) on the tiny SD1.5 with
   generated captions, three steps per option: it must exit 0 and write the LoRA.
Exit status 0 when every check passed. `--json PATH` writes the figures. `--device cpu` runs part 1
for bf16 and fp8 only, to try the script on a machine without a GPU (nothing is proven then).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

GIB = 1024 ** 3


@dataclass(frozen=True)
class Variant:
    name: str
    quantization: str | None = None
    optimizer: str = "adamw"


VARIANTS = [
    Variant("bf16 (baseline)"),
    Variant("fp8", quantization="fp8"),
    Variant("nf4", quantization="nf4"),
    Variant("adamw8bit", optimizer="adamw8bit"),
    Variant("fp8 + adamw8bit", quantization="fp8", optimizer="adamw8bit"),  # the flux-kontext-edit example
    Variant("nf4 + adamw8bit", quantization="nf4", optimizer="adamw8bit"),  # the qwen-image-edit example
]


@dataclass
class Result:
    variant: str
    status: str = "ok"              # ok | refused (as designed) | FAILED
    detail: str = ""
    weights_gib: float = 0.0        # allocated after loading, quantizing and attaching the LoRA
    peak_gib: float = 0.0           # peak allocated while training
    seconds_per_step: float = 0.0
    first_loss: float = 0.0
    last_loss: float = 0.0
    checks: list[str] = field(default_factory=list)


# --- part 1: one variant, in this process ------------------------------------------------------

def frozen_checksums(model) -> dict[str, float]:
    """One number per frozen parameter (its stored bits as floats), to show training left them alone."""
    import torch

    sums = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        stored = getattr(param, "qdata", param)  # a torchao Float8Tensor keeps its float8 data in qdata
        raw = stored.detach().view(torch.uint8) if stored.is_floating_point() else stored.detach()
        sums[name] = raw.double().sum().item()
    return sums


def evidence(variant: Variant, unet, optimizer) -> list[str]:
    """That the option was applied, not silently ignored; an empty description means it was not."""
    import torch

    found = []
    if variant.quantization == "fp8":
        from kubetune_trainer.training.fp8 import Float8FrozenLinear

        count = sum(isinstance(m, Float8FrozenLinear) for m in unet.modules())
        found.append(f"{count} float8 Linear layers" if count else "")
    if variant.quantization == "nf4":
        import bitsandbytes as bnb

        count = sum(isinstance(m, bnb.nn.Linear4bit) for m in unet.modules())
        found.append(f"{count} 4-bit Linear layers" if count else "")
    if variant.optimizer == "adamw8bit":
        states = [s for state in optimizer.state.values() for s in state.values()
                  if torch.is_tensor(s) and s.dtype == torch.uint8]
        found.append(f"{len(states)} uint8 optimizer states" if states else "")
    return found


def run_variant(variant: Variant, model_dir: Path, device: str, steps: int, batch_size: int) -> Result:
    import torch

    from kubetune_api.spec_model import AdapterSpec
    from kubetune_api.spec_training import TrainingSpec
    from kubetune_trainer.training import optim, quantization
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS, attach_lora

    result = Result(variant.name)
    on_gpu = device == "cuda"
    if on_gpu:
        try:
            quantization.check_supported(variant.quantization)
        except ConfigError as refusal:
            capability = quantization.cuda_capability()
            if variant.quantization == "fp8" and capability < quantization.FP8_MIN_CAPABILITY:
                result.status, result.detail = "refused (as designed)", str(refusal)
            else:
                result.status, result.detail = "FAILED", str(refusal)
            return result
        torch.cuda.reset_peak_memory_stats()
    from diffusers import UNet2DConditionModel

    dtype = torch.bfloat16
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", torch_dtype=dtype,
                                                **quantization.load_kwargs(variant.quantization, dtype))
    quantization.apply_after_load(variant.quantization, unet, dtype)
    attach_lora(unet, AdapterSpec(rank=16), DIFFUSERS_ATTENTION_TARGETS)
    unet.to(device).train()
    lora = [p for p in unet.parameters() if p.requires_grad]
    spec = TrainingSpec.model_validate({"maxSteps": steps, "optimizer": variant.optimizer, "learningRate": 1e-4})
    optimizer = optim.build_optimizer(lora, spec)
    if on_gpu:
        torch.cuda.synchronize()
        result.weights_gib = torch.cuda.memory_allocated() / GIB
    lora_before = [p.detach().clone() for p in lora]
    frozen_before = frozen_checksums(unet)

    config = unet.config
    size = config.sample_size
    generator = torch.Generator(device).manual_seed(0)
    losses, started = [], None
    warmup = 2
    for step in range(warmup + steps):
        if step == warmup:
            if on_gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
        latents = torch.randn(batch_size, config.in_channels, size, size, generator=generator, device=device)
        text = torch.randn(batch_size, 77, config.cross_attention_dim, generator=generator, device=device)
        timesteps = torch.randint(0, 1000, (batch_size,), generator=generator, device=device)
        noise = torch.randn(latents.shape, generator=generator, device=device)
        with torch.autocast(device, dtype=dtype):
            prediction = unet(latents + noise, timesteps, text).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a sync: each step is timed whole
    result.seconds_per_step = (time.perf_counter() - started) / steps
    if on_gpu:
        result.peak_gib = torch.cuda.max_memory_allocated() / GIB
    result.first_loss, result.last_loss = losses[0], losses[-1]

    problems = []
    applied = evidence(variant, unet, optimizer)
    if "" in applied:
        problems.append("the option was not applied")
    if not all(torch.isfinite(torch.tensor(losses))):
        problems.append(f"non-finite loss {losses}")
    if not any(not torch.equal(before, after) for before, after in zip(lora_before, lora)):
        problems.append("the LoRA did not change")
    if frozen_checksums(unet) != frozen_before:
        problems.append("frozen base weights changed")
    result.checks = [c for c in applied if c] + ["loss finite", "LoRA moved", "base unchanged"]
    if problems:
        result.status, result.detail = "FAILED", "; ".join(problems)
    return result


# --- part 2: the trainer, as the image runs it ---------------------------------------------------

def run_trainer(variant: Variant, model_dir: Path, data_dir: Path, out: Path,
                expect_refusal: bool) -> tuple[bool, str, float]:
    """(passed, what happened, seconds): trained and wrote the LoRA, or (expect_refusal) exited 2 naming fp8."""
    from kubetune_api import layout

    spec = {
        "model": {"family": "sd15", "pretrained": str(model_dir)},
        "adapter": {"type": "lora", "rank": 4},
        "data": {"layout": "captions", "uri": str(data_dir), "resolution": 32},
        "training": {"maxSteps": 3, "batchSize": 2, "learningRate": 1e-4, "mixedPrecision": "bf16",
                     "optimizer": variant.optimizer},
        "checkpoints": {"uri": str(out), "everySteps": 3, "keepLast": 1},
        "resources": {"gpusPerNode": 1},
    }
    if variant.quantization:
        spec["model"]["quantization"] = variant.quantization
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump({"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob",
                                      "metadata": {"name": "gpu-check"}, "spec": spec}))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kubetune_trainer", "--config", str(config)],
                          capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    lora = Path(layout.run_root(str(out), "default", "gpu-check", 0)) / "pytorch_lora_weights.safetensors"
    if expect_refusal:
        refused = done.returncode == 2 and "fp8 needs compute capability 8.9+" in done.stderr
        return refused, f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}", seconds
    if done.returncode != 0:
        return False, f"exit {done.returncode}: {done.stderr.strip()[-2000:]}", seconds
    if not lora.is_file():
        return False, f"exit 0 but no {lora}", seconds
    return True, str(lora), seconds


# --- driver ------------------------------------------------------------------------------------

def child(args) -> None:
    """One part-1 variant in this (fresh) process; the Result as JSON on the last stdout line."""
    variant = next(v for v in VARIANTS if v.name == args.child)
    try:
        result = run_variant(variant, args.model_dir, args.device, args.steps, args.batch_size)
    except Exception as err:  # reported, not raised: the other variants still run
        result = Result(variant.name, status="FAILED", detail=f"{type(err).__name__}: {err}")
    print(json.dumps(asdict(result)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny SD1.5 (32 px images, 16x16 latents)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per variant, after 2 warm-up steps")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--workdir", type=Path, help="keep models and data here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 2 if args.tiny or args.device == "cpu" else 4
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_quantization_check: needs a CUDA GPU (this machine has none); --device cpu only tries the script",
              file=sys.stderr)
        return 2
    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kubetune-gpu-check-"))
    full_size = not args.tiny and args.device == "cuda"
    model_dir = workdir / ("sd15-full" if full_size else "sd15-tiny")
    tiny_dir, data_dir = workdir / "sd15-tiny", workdir / "captions"
    for directory, write in ((model_dir, lambda d: write_tiny_model("sd15", d, full_size=full_size)),
                             (tiny_dir, lambda d: write_tiny_model("sd15", d)),
                             (data_dir, lambda d: write_tiny_data("captions", d, count=8, size=32))):
        if not directory.exists():
            write(directory)
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        print(f"GPU: {name}, compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}, "
              f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"part 1: {'full-size' if full_size else 'tiny'} SD1.5 UNet, batch {args.batch_size}, "
          f"{args.steps} steps after 2 warm-up, LoRA rank 16, bf16 autocast, {args.device}")

    variants = VARIANTS
    if args.device == "cpu":  # nf4 and adamw8bit are CUDA-only (refused by the trainer on the CPU)
        variants = [v for v in VARIANTS if v.quantization != "nf4" and v.optimizer != "adamw8bit"]
        print(f"  --device cpu: only {', '.join(v.name for v in variants)}; memory is not measured")
    results = []
    for variant in variants:
        command = [sys.executable, __file__, "--child", variant.name, "--model-dir", str(model_dir),
                   "--device", args.device, "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        try:
            result = Result(**json.loads(done.stdout.strip().splitlines()[-1]))
        except (IndexError, ValueError, TypeError):
            result = Result(variant.name, status="FAILED", detail=f"exit {done.returncode}: {done.stderr[-2000:]}")
        results.append(result)
        print(f"  {result.variant:18} {result.status:22} weights {result.weights_gib:6.2f} GiB  "
              f"peak {result.peak_gib:6.2f} GiB  {result.seconds_per_step:7.3f} s/step  "
              f"loss {result.first_loss:.4f} -> {result.last_loss:.4f}  {', '.join(result.checks)}")
        if result.detail:
            print(f"      {result.detail}")
    baseline = results[0]
    if args.device == "cuda" and baseline.status == "ok":
        for result in results:
            quantized = next(v for v in VARIANTS if v.name == result.variant).quantization
            if quantized and result.status == "ok" and result.weights_gib >= baseline.weights_gib:
                result.status = "FAILED"
                result.detail = f"weights {result.weights_gib:.2f} GiB, not less than bf16's {baseline.weights_gib:.2f}"
                print(f"  {result.variant}: FAILED: {result.detail}")

    trainer_runs = []
    if args.device == "cuda":
        print("part 2: the trainer (python -m kubetune_trainer), tiny SD1.5, 3 steps, gpusPerNode 1")
        for variant in VARIANTS[1:]:
            refused = next(r for r in results if r.variant == variant.name).status == "refused (as designed)"
            out = workdir / f"run-{variant.name.replace(' ', '')}"
            ok, detail, seconds = run_trainer(variant, tiny_dir, data_dir, out, expect_refusal=refused)
            trainer_runs.append({"variant": variant.name, "ok": ok, "detail": detail, "seconds": seconds})
            outcome = ("refused (as designed)" if refused else "ok") if ok else "FAILED"
            print(f"  {variant.name:18} {outcome} in {seconds:.1f} s: {detail}")

    if args.json:
        args.json.write_text(json.dumps({"part1": [asdict(r) for r in results], "part2": trainer_runs}, indent=1))
    failed = [r.variant for r in results if r.status == "FAILED"] + [r["variant"] for r in trainer_runs if not r["ok"]]
    print("all checks passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
