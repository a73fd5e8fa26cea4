"""Operator latency: `kubectl apply` of many TrainingJobs at once → child PyTorchJob → status.

    .venv/bin/python benchmarks/operator_latency.py                 # 200 jobs (+ 5 that run)
    .venv/bin/python benchmarks/operator_latency.py --jobs 50 --running-jobs 0

Brings up its own local control plane (kubetune dev up in a temporary home), installs the chart
with helm (the operator runs as a pod), applies N TrainingJobs in one `kubectl apply`, and records
from a watch when each PyTorchJob appears and when each TrainingJob's status gets its first
phase. The N jobs are suspended (spec.suspend: true): the operator does all of its work, but no
trainer pods start, which 200 CPU trainers on one small machine could not. A few extra jobs run
for real to time `apply → phase Running`. Prints p50/p99 and the operator's peak resident memory.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "latency"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def job_manifest(name: str, suspend: bool, data_uri: str, model_uri: str) -> dict:
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": NAMESPACE}
    spec = manifest["spec"]
    spec["model"]["pretrained"] = model_uri
    spec["data"].update(uri=data_uri, resolution=32)
    spec["training"].update(maxSteps=2, batchSize=2, mixedPrecision="no")
    spec["checkpoints"]["uri"] = f"/tmp/kubetune-latency/{name}"
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["suspend"] = suspend
    return manifest


class Recorder:
    """Watches PyTorchJobs and TrainingJobs; remembers when each first reached a state."""

    def __init__(self, api_client):
        from kubernetes import client, watch

        self.custom = client.CustomObjectsApi(api_client)
        self.watch = watch
        self.child_seen: dict[str, float] = {}
        self.phase_seen: dict[tuple[str, str], float] = {}
        self.stop = threading.Event()

    def _follow(self, group, version, plural, on_event):
        while not self.stop.is_set():
            stream = self.watch.Watch()
            for event in stream.stream(self.custom.list_namespaced_custom_object, group, version, NAMESPACE,
                                       plural, timeout_seconds=5):
                on_event(event["object"], time.monotonic())
                if self.stop.is_set():
                    stream.stop()

    def start(self) -> None:
        def child(obj, now):
            owner = (obj["metadata"].get("ownerReferences") or [{}])[0].get("name")
            if owner:
                self.child_seen.setdefault(owner, now)

        def job(obj, now):
            phase = (obj.get("status") or {}).get("phase")
            if phase:
                self.phase_seen.setdefault((obj["metadata"]["name"], phase), now)

        for args in (("kubeflow.org", "v1", "pytorchjobs", child), ("kubetune.dev", "v1alpha1", "trainingjobs", job)):
            threading.Thread(target=self._follow, args=args, daemon=True).start()


def operator_rss_sampler(stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        for process in psutil.process_iter(["cmdline", "memory_info"]):
            cmdline = process.info["cmdline"] or []
            if "kubetune_operator" in cmdline and process.info["memory_info"]:
                peak[0] = max(peak[0], process.info["memory_info"].rss)
        time.sleep(0.2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, help="suspended TrainingJobs applied at once")
    parser.add_argument("--running-jobs", type=int, default=5, help="extra jobs that really run (apply → Running)")
    parser.add_argument("--operator-log", type=Path, help="copy the operator pod's log here at the end")
    args = parser.parse_args(argv)

    from kubernetes import client, config

    from kubetune_dev.cluster import Cluster
    from kubetune_trainer.tiny_data import write_tiny_data
    from kubetune_trainer.tiny_models import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="kubetune-latency-") as tmp:
        cluster = Cluster(Path(tmp) / "cluster", log=lambda line: None)
        started = time.monotonic()
        cluster.up()
        print(f"control plane up in {time.monotonic() - started:.1f} s")
        try:
            env = {**os.environ, **cluster.env()}
            subprocess.run(["helm", "install", "kubetune", str(REPO / "charts" / "kubetune"), "-n", "kubetune-system",
                            "--create-namespace", "--wait", "--timeout", "180s",
                            "--set", "operator.image.repository=kubetune/operator",
                            "--set", "trainer.image=kubetune/trainer:dev"], env=env, check=True, capture_output=True)
            cluster.kubectl("create", "namespace", NAMESPACE)
            model = write_tiny_model("sd15", Path(tmp) / "model")
            data = write_tiny_data("captions", Path(tmp) / "data", count=4, size=32)
            api = config.new_client_from_config(config_file=str(cluster.kubeconfig()))
            recorder = Recorder(api)
            recorder.start()
            stop, peak = threading.Event(), [0]
            threading.Thread(target=operator_rss_sampler, args=(stop, peak), daemon=True).start()
            time.sleep(2)

            names = [f"lat-{i:03d}" for i in range(args.jobs)]
            running = [f"run-{i:02d}" for i in range(args.running_jobs)]
            documents = [yaml.safe_dump(job_manifest(n, True, str(data), str(model))) for n in names]
            documents += [yaml.safe_dump(job_manifest(n, False, str(data), str(model))) for n in running]
            applied = time.monotonic()
            cluster.kubectl("apply", "-f", "-", input="---\n".join(documents))
            print(f"kubectl apply of {len(documents)} TrainingJobs took {time.monotonic() - applied:.1f} s")

            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and (
                    len(recorder.child_seen) < len(documents)
                    or sum((n, "Suspended") in recorder.phase_seen for n in names) < len(names)
                    or sum((n, "Running") in recorder.phase_seen or (n, "Succeeded") in recorder.phase_seen
                           for n in running) < len(running)):
                time.sleep(0.5)
            stop.set()
            recorder.stop.set()

            created = [recorder.child_seen[n] - applied for n in names + running if n in recorder.child_seen]
            status = [recorder.phase_seen[(n, "Suspended")] - applied for n in names if (n, "Suspended") in recorder.phase_seen]
            runs = [min(recorder.phase_seen.get((n, p), float("inf")) for p in ("Running", "Succeeded")) - applied
                    for n in running]
            runs = [r for r in runs if r != float("inf")]

            def line(label, values, of):
                if not values:
                    return f"{label:38s} none of {of} observed"
                return (f"{label:38s} p50 {statistics.median(values):6.2f} s   p99 {percentile(values, 99):6.2f} s"
                        f"   ({len(values)}/{of})")

            print(line("apply → PyTorchJob created", created, len(documents)))
            print(line("apply → status.phase (Suspended)", status, len(names)))
            print(line("apply → status.phase Running", runs, len(running)))
            print(f"operator peak RSS: {peak[0] / 2**20:.0f} MiB")
            if args.operator_log:
                logs = sorted((Path(tmp) / "cluster" / "kubelet" / "pods").glob("kubetune-system_*/logs/operator.log"))
                args.operator_log.write_text("".join(p.read_text() for p in logs))
        finally:
            cluster.down()


if __name__ == "__main__":
    sys.exit(main())
