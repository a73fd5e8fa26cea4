"""Several processes: throughput at 1, 2 and 4 processes, and DDP against FSDP on a mid-size UNet.

    .venv/bin/python benchmarks/distributed_scaling.py                  # both tables
    .venv/bin/python benchmarks/distributed_scaling.py --only scaling   # or --only strategies

Runs the real trainer (`kubetune train --nproc N`, the node launcher, gloo on the CPU) and reads
its TensorBoard events for step times, while a sampling thread records every trainer process's
resident memory (/proc/<pid>/status, every 50 ms) for its peak.

scaling     the tiny SD1.5 LoRA, batch --batch-size per process (the global batch grows with the
            processes), one thread per process: samples/s after warm-up and the scaling efficiency
            (samples/s at N / (N x samples/s at 1)). This machine has 2 cores, so 4 processes share
            them: the 4-process row shows oversubscription, not a 4-GPU node.
strategies  a mid-size UNet (SD1.5's block layout at 1/2.5 of its width, ~140M parameters, random
            weights) fully fine-tuned by 2 processes with AdamW, under ddp and under fsdp: seconds per
            step and peak resident memory per process. Under DDP every process holds the weights,
            gradients and AdamW state whole; under FSDP half of each.
A benchmark, not a test: it prints figures and asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["scaling", "strategies"])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="keep models and runs here (default: a temporary directory)")
    return parser.parse_args(argv)


class PeakMemory:
    """Peak resident memory of every process below `root` (the launcher's trainer processes)."""

    def __init__(self, root: int):
        self.root = root
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _children(self) -> list[int]:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = [], [self.root]
        while frontier:
            parent = frontier.pop()
            kids = [pid for pid, ppid in parents.items() if ppid == parent]
            found += kids
            frontier += kids
        return found

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            for pid in self._children():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                if "kubetune_trainer" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    continue
                rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
                self.peaks[pid] = max(self.peaks.get(pid, 0), rss * 1024)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return sorted(self.peaks.values())


def train(manifest: dict, workdir: Path, name: str, nproc: int) -> tuple[list[float], list[int]]:
    """Run `kubetune train --nproc N`; (step end times, peak memory of each trainer process)."""
    out = workdir / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)  # a kept --workdir must not hand back an older run's events
    manifest["spec"]["checkpoints"]["uri"] = str(out)
    config = workdir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(manifest))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "kubetune_cli.main", "train", "-f", str(config),
                                "--nproc", str(nproc)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    memory = PeakMemory(process.pid)
    _, stderr = process.communicate()
    peaks = memory.stop()
    if process.returncode:
        sys.exit(f"{name} failed:\n{stderr[-4000:]}")
    return step_end_times(out / "default" / "bench" / "v0" / "logs"), peaks


def step_end_times(log_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    return [e.wall_time for e in sorted(events.Scalars("train/loss"), key=lambda e: e.step)]


def steady_seconds_per_step(times: list[float], warmup: int) -> float:
    measured = times[warmup - 1:]
    return statistics.median(b - a for a, b in zip(measured, measured[1:]))


def job(model: Path, data: Path, batch: int, steps: int, **spec) -> dict:
    return {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "bench"},
        "spec": {
            "model": {"family": "sd15", "pretrained": str(model)},
            "data": {"layout": "captions", "uri": str(data), "resolution": 32},
            "training": {"maxSteps": steps, "batchSize": batch, "learningRate": 1e-4},
            "checkpoints": {"uri": "", "everySteps": 10_000_000, "keepLast": 1},
            "resources": {"gpusPerNode": 0},
            **spec,
        },
    }


def mid_size_model(directory: Path) -> Path:
    """The tiny SD1.5 pipeline with its UNet replaced by SD1.5's block layout at reduced width."""
    import torch
    from diffusers import UNet2DConditionModel

    from kubetune_trainer.models.tiny_models import write_tiny_model

    if (directory / "unet" / "config.json").exists():
        return directory
    write_tiny_model("sd15", directory, seed=0)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    )
    unet.save_pretrained(directory / "unet")
    return directory


def scaling(args, workdir: Path) -> None:
    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    model = workdir / "tiny-sd15"
    if not model.exists():
        write_tiny_model("sd15", model, seed=0)
    data = workdir / "captions"
    if not data.exists():
        write_tiny_data("captions", data, count=args.batch_size * max(args.processes) * 4, size=32)
    print(f"\nScaling: tiny SD1.5 LoRA, batch {args.batch_size} per process, 32 px, fp32, gloo, 1 thread each")
    print("| processes | global batch | s/step | samples/s | efficiency |\n|---|---|---|---|---|")
    base = None
    for nproc in args.processes:
        manifest = job(model, data, args.batch_size, args.warmup_steps + args.steps,
                       adapter={"type": "lora", "rank": 8, "alpha": 8})
        times, _ = train(manifest, workdir, f"scaling-{nproc}", nproc)
        seconds = steady_seconds_per_step(times, args.warmup_steps)
        rate = args.batch_size * nproc / seconds
        base = base or rate
        print(f"| {nproc} | {args.batch_size * nproc} | {seconds:.3f} | {rate:.1f} | {rate / (nproc * base):.2f} |",
              flush=True)


def strategies(args, workdir: Path) -> None:
    from kubetune_trainer.data.tiny_data import write_tiny_data

    model = mid_size_model(workdir / "mid-sd15")
    data = workdir / "captions-mid"
    if not data.exists():
        write_tiny_data("captions", data, count=16, size=32)
    from diffusers import UNet2DConditionModel

    params = sum(p.numel() for p in UNet2DConditionModel.from_pretrained(model, subfolder="unet").parameters())
    print(f"\nDDP vs FSDP: a {params / 1e6:.0f}M-parameter UNet, full fine-tune, AdamW, 2 processes x batch 2, "
          "32 px, fp32, gloo")
    print("| strategy | s/step | peak resident memory per process (GiB) |\n|---|---|---|")
    for strategy in ("ddp", "fsdp"):
        manifest = job(model, data, 2, args.warmup_steps + args.steps // 2, adapter={"type": "full"},
                       distributed={"strategy": strategy})
        times, peaks = train(manifest, workdir, f"strategy-{strategy}", 2)
        seconds = steady_seconds_per_step(times, args.warmup_steps)
        print(f"| {strategy} | {seconds:.2f} | {' / '.join(f'{p / 2**30:.2f}' for p in peaks)} |", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kubetune-dist-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "scaling"):
        scaling(args, workdir)
    if args.only in (None, "strategies"):
        strategies(args, workdir)


if __name__ == "__main__":
    main()
