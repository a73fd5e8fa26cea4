"""How close is `kubetune plan` to a real training step? Estimate vs measured peak memory on the CPU.

    .venv/bin/python benchmarks/plan_accuracy.py                  # every case below
    .venv/bin/python benchmarks/plan_accuracy.py --cases sd15,classifier

For each case: the real architecture (configs from kubetune_trainer.models.reference_models, random
weights) is estimated for device=cpu by the planner, then measured in a fresh process: the
models are materialised on the CPU in the dtypes the trainer uses (the trainer's own LoRA
attachment), and two training steps run — the family's training forward (the planner's recipe,
which mirrors the family's compute_loss), backward, gradient clipping and an optimizer step from
the trainer's build_optimizer — under CPU autocast as Accelerate applies it. A thread samples
the resident set (/proc/self/statm) every millisecond; glibc is told to give freed memory back
at once (MALLOC_MMAP_THRESHOLD_), so the resident set follows what is allocated.

Printed per case: estimated and measured peak (both above the process's baseline before the
models are built), the part above the weights (what the estimator has to get right beyond
counting parameters), and measured/estimated ratios. A benchmark: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GIB = 2**30
HERE = Path(__file__).resolve()

# name -> (family, layout, resolution, batch, precision, adapter, checkpointing)
CASES = {
    "sd15": ("sd15", "captions", 256, 8, "bf16", "lora", False),
    "sd15-checkpointing": ("sd15", "captions", 256, 8, "bf16", "lora", True),
    "sdxl": ("sdxl", "captions", 256, 4, "bf16", "lora", False),
    "classifier": ("classifier", "image-folder", 224, 32, "bf16", "full", False),
    "classifier-fp32": ("classifier", "image-folder", 224, 16, "no", "lora", False),
}


def case_spec(name: str, model_dir: Path):
    from kubetune_api.spec import TrainingJobSpec

    family, layout, resolution, batch, precision, adapter, checkpointing = CASES[name]
    return TrainingJobSpec.model_validate({
        "model": {"family": family, "pretrained": str(model_dir)},
        "adapter": {"type": adapter, "rank": 8},
        "data": {"layout": layout, "uri": "/unused", "resolution": resolution},
        "training": {"maxSteps": 2, "batchSize": batch, "mixedPrecision": precision,
                     "gradientCheckpointing": checkpointing},
        "checkpoints": {"uri": "/unused"},
        "resources": {"gpusPerNode": 0},
    })


def plan_command(name: str) -> str:
    family, _, resolution, batch, precision, adapter, checkpointing = CASES[name]
    return (f"kubetune plan -f JOB.yaml --device cpu --set spec.model.pretrained=MODEL "
            f"--set spec.data.resolution={resolution} --set spec.training.batchSize={batch} "
            f"--set spec.training.mixedPrecision={precision} --set spec.adapter.type={adapter}"
            + (" --set spec.training.gradientCheckpointing=true" if checkpointing else ""))


# --- the measured side (runs in its own process) ----------------------------------------------

class PeakResident(threading.Thread):
    """Samples this process's resident set size until stopped; keeps the maximum."""

    def __init__(self):
        super().__init__(daemon=True)
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self.running = True

    def now(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def run(self):
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)


def materialise(models) -> None:
    """Real CPU tensors in place of the meta ones, same dtypes, filled (untouched pages would not count)."""
    import torch

    for model in models.components.values():
        model.to_empty(device="cpu")
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                if tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
                else:
                    tensor.zero_()


def measure(name: str, model_dir: Path) -> dict:
    import torch

    from kubetune_trainer.families import definition_for
    from kubetune_trainer.training.optim import build_optimizer
    from kubetune_trainer.planning.models import load_models, weight_dtype

    torch.manual_seed(0)
    spec = case_spec(name, model_dir)
    definition = definition_for(spec.model.family)  # its planning forward and gradient checkpointing
    load_models(spec)  # on the meta device: imports every library the models need before the baseline
    sampler = PeakResident()
    sampler.start()
    time.sleep(0.05)
    baseline = sampler.now()
    models = load_models(spec)
    materialise(models)
    if spec.training.gradient_checkpointing:
        definition.enable_gradient_checkpointing(models.components)
    models.trained_module.train()
    built = sampler.now()
    dtype = weight_dtype(spec)
    params = [p for p in models.trained_module.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, spec.training)

    def make(shape, tensor_dtype):
        if tensor_dtype.is_floating_point:
            return torch.randn(shape, dtype=tensor_dtype)
        return torch.ones(shape, dtype=tensor_dtype)

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    started = time.perf_counter()
    for _ in range(2):
        loss = definition.forward(models.components, spec, make, autocast, dtype)
        loss.backward()
        del loss
        torch.nn.utils.clip_grad_norm_(params, spec.training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    sampler.running = False
    sampler.join()
    return {"weights": built - baseline, "peak": sampler.peak - baseline, "seconds": seconds}


# --- the driver ---------------------------------------------------------------------------------

def estimate(name: str, model_dir: Path):
    from kubetune_trainer.planning.estimate import Planner

    return Planner("cpu").estimate(case_spec(name, model_dir), 1, "ddp")


def run_measurement(name: str, model_dir: Path) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
           "OMP_NUM_THREADS": str(os.cpu_count())}
    result = subprocess.run([sys.executable, str(HERE), "--measure", name, "--model-dir", str(model_dir)],
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.model_dir)))
        return

    import logging
    import warnings

    from kubetune_trainer.models.reference_models import write_config_only

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            family = CASES[name][0]
            model_dir = Path(tmp) / family
            if not model_dir.exists():
                write_config_only(family, model_dir)
            planned = estimate(name, model_dir)
            measured = run_measurement(name, model_dir)
            planned_dynamic = planned.total - planned.weights
            measured_dynamic = measured["peak"] - measured["weights"]
            rows.append((name, planned.total, measured["peak"], planned_dynamic, measured_dynamic,
                         planned.weights, measured["weights"], measured["seconds"]))
            print(f"{name}: {plan_command(name)}", flush=True)
    print("\n| case | estimated peak | measured peak | measured/estimated | estimated above weights "
          "| measured above weights | measured/estimated | weights est./meas. | 2 steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, est, meas, est_dyn, meas_dyn, est_w, meas_w, seconds in rows:
        print(f"| {name} | {est / GIB:.2f} GiB | {meas / GIB:.2f} GiB | {meas / est:.2f} | {est_dyn / GIB:.2f} GiB "
              f"| {meas_dyn / GIB:.2f} GiB | {meas_dyn / est_dyn:.2f} | {est_w / GIB:.2f} / {meas_w / GIB:.2f} GiB "
              f"| {seconds:.0f} s |")


if __name__ == "__main__":
    main()
