"""What metrics and progress reporting cost a training step.

    .venv/bin/python benchmarks/metrics_overhead.py
    python3 benchmarks/metrics_overhead.py --device cuda     # on a GPU (benchmarks/gpu_suite.sh)

1. Per step, in-process: everything the loop does to report a step (three phase marks, the
   progress bar, TensorBoard scalars, Prometheus gauges and the step histogram, the GPU-memory
   gauges; on --device cuda the clock's CUDA events and the trainer's memory readout) timed over
   many steps, with the metrics served on a port and scraped every 100 ms
   (far more often than Prometheus' 15-30 s or the operator's progress poll).
2. End to end: the real trainer on the tiny SD1.5 model, steady-state samples/s with its metrics
   served and scraped every second, against the same run with no metrics port, alternating.
Figures are printed (a benchmark, not a test: nothing is asserted).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from kubetune_api.ports import free_listen_port

HERE = Path(__file__).resolve().parent


class Scraper:
    """Fetches /metrics every `interval` seconds in a thread, as Prometheus would."""

    def __init__(self, port: int, interval: float):
        self.url, self.interval, self.scrapes = f"http://127.0.0.1:{port}/metrics", interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                urllib.request.urlopen(self.url, timeout=2).read()
                self.scrapes += 1
            except OSError:
                pass  # the trainer is not serving yet

    def stop(self):
        self._stop.set()
        self._thread.join()


def reporting_cost_per_step(steps: int, device) -> float:
    """Seconds the loop spends reporting one step (served + scraped every 100 ms)."""
    import torch

    from kubetune_trainer.telemetry.phase_clock import PhaseClock
    from kubetune_trainer.telemetry.reporting import Reporter

    port = free_listen_port()
    os.environ.update(KUBETUNE_METRICS_PORT=str(port), KUBETUNE_METRICS_ADDR="127.0.0.1")
    devnull = open(os.devnull, "w")
    stderr, sys.stderr = sys.stderr, devnull  # the bar's output goes to a pipe in a pod
    try:
        with tempfile.TemporaryDirectory() as logs:
            reporter = Reporter(True, total_steps=10 * steps, start_step=0, log_dir=Path(logs), log_every=1,
                                samples_per_step=8, namespace="bench", job_name="bench")
            scraper = Scraper(port, 0.1)
            clock = PhaseClock(reporter, device)
            started = time.perf_counter()
            for step in range(1, steps + 1):
                clock.mark("data_wait")
                clock.mark("forward_backward")
                clock.mark("optimizer")
                reporter.step(step, 0.1, 1e-4, 0)
                reporter.gpu_memory([gpu_memory_in_use(device)])
                clock.restart()
            elapsed = time.perf_counter() - started
            scraper.stop()
            reporter.close()
    finally:
        sys.stderr = stderr
        devnull.close()
        for key in ("KUBETUNE_METRICS_PORT", "KUBETUNE_METRICS_ADDR"):
            os.environ.pop(key, None)
    print(f"  ({scraper.scrapes} scrapes during {steps} steps)")
    return elapsed / steps


def gpu_memory_in_use(device) -> tuple[int, int]:
    """What the trainer reads each logged step (Run._gather_memory, without the one-process gather)."""
    import torch

    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def throughput(served: bool, model: Path, data: Path, work: Path, steps: int, warmup: int, gpus: int) -> float:
    """Steady-state samples/s of the real trainer (tiny SD1.5, batch 8, 32 px, fp32)."""
    bench = load_throughput_module()
    out = work / f"run-{'served' if served else 'quiet'}-{time.monotonic_ns()}"
    manifest = {
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "bench"},
        "spec": {
            "model": {"family": "sd15", "pretrained": str(model)},
            "adapter": {"type": "lora", "rank": 8, "alpha": 8},
            "data": {"layout": "captions", "uri": str(data), "resolution": 32},
            "training": {"maxSteps": warmup + steps, "batchSize": 8, "learningRate": 1e-4, "mixedPrecision": "no"},
            "checkpoints": {"uri": str(out), "everySteps": 10_000_000, "keepLast": 1},
            "resources": {"gpusPerNode": gpus},
        },
    }
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(manifest))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETUNE_METRICS")}
    scraper = None
    if served:
        port = free_listen_port()
        env.update(KUBETUNE_METRICS_PORT=str(port), KUBETUNE_METRICS_ADDR="127.0.0.1")
        scraper = Scraper(port, 1.0)
    result = subprocess.run([sys.executable, "-m", "kubetune_trainer", "--config", str(config)], env=env,
                            capture_output=True, text=True)
    if scraper is not None:
        scraper.stop()
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    times = bench.step_times_from_events(bench.newest_run(out) / "logs")
    return bench.steady_rate(times, {"warmup_steps": warmup, "batch_size": 8})


def load_throughput_module():
    spec = importlib.util.spec_from_file_location("trainer_throughput", HERE / "trainer_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-steps", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=30, help="measured trainer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=2, help="served/quiet run pairs, alternating")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run it on a GPU machine (benchmarks/gpu_suite.sh)")
    device = torch.device(args.device)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")

    print("1. reporting one step, in-process, metrics served and scraped every 100 ms:")
    per_step = reporting_cost_per_step(args.micro_steps, device)
    print(f"   {per_step * 1e6:.0f} µs per step")

    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_tiny_model("sd15", work / "model")
        data = write_tiny_data("captions", work / "data", count=32, size=32)
        rates = {True: [], False: []}
        for _ in range(args.pairs):
            for served in (True, False):
                rates[served].append(throughput(served, model, data, work, args.steps, args.warmup_steps,
                                                int(device.type == "cuda")))
                print(f"   {'served+scraped' if served else 'no metrics port'}: {rates[served][-1]:.2f} samples/s")
    served, quiet = statistics.median(rates[True]), statistics.median(rates[False])
    step_ms = 8 / quiet * 1000
    print(f"2. the real trainer, tiny SD1.5, batch 8, 32 px, fp32, {args.device} (medians):")
    print(f"   no metrics port {quiet:.2f} samples/s ({step_ms:.0f} ms/step); served and scraped every 1 s "
          f"{served:.2f} samples/s; difference {100 * (quiet - served) / quiet:+.1f} %")
    print(f"   reporting per step = {per_step * 1e6:.0f} µs = {100 * per_step / (step_ms / 1000):.2f} % of this "
          f"toy step (less on any real model: a GPU SD1.5 step is ~100x longer)")


if __name__ == "__main__":
    main()
