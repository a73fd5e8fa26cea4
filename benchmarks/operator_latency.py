"""Operator latency, per backend: each TrainingJob's creation → its child job → its status.phase.

    .venv/bin/python benchmarks/operator_latency.py                          # both backends, 200 jobs (+ 5 that run)
    .venv/bin/python benchmarks/operator_latency.py --backend trainjob --jobs 50 --running-jobs 0
    .venv/bin/python -u benchmarks/operator_latency.py --jobs 5000 --running-jobs 0   # issue 29's scale

Brings up its own local control plane (kubetune dev up in a temporary home) and, for each backend,
installs the chart with helm (the operator runs as a pod, `backend: <name>`), creates N TrainingJobs
with a few `kubectl create` processes at once (--apply-processes), and times each job from its own
creation, not from the start of the creation (creating 5,000 objects takes minutes by itself):

  * created: when the watch delivered the TrainingJob's ADDED event (creationTimestamp has 1 s
    resolution; a watch on loopback delivers within milliseconds);
  * → child created: when the watch delivered the child job (PyTorchJob or TrainJob) it owns;
  * → phase written: when the watch delivered the TrainingJob with a status.phase.
The creationTimestamp difference (child − TrainingJob, whole seconds) is printed as a cross-check.

The N jobs are suspended (spec.suspend: true): the operator does all of its work, but no trainer
pods start, which 200 CPU trainers on one small machine could not. A few extra jobs run for real to
time creation → phase Running. Prints p50/p99 and the operator's peak resident memory (targets
at 5,000 jobs: child created p99 ≤ 1 s, status.phase p99 ≤ 2 s, ≤ 300 MiB).
"""
from __future__ import annotations

import argparse
import datetime
import fcntl
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("pytorchjob", "trainjob")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def timestamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def job_manifest(name: str, namespace: str, suspend: bool, data_uri: str, model_uri: str) -> dict:
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": namespace}
    spec = manifest["spec"]
    spec["model"]["pretrained"] = model_uri
    spec["data"].update(uri=data_uri, resolution=32)
    spec["training"].update(maxSteps=2, batchSize=2, mixedPrecision="no")
    # Checkpoints on this machine's disk, through a hostPath volume (on a cluster a local path lies in one).
    spec["volumes"] = [{"name": "runs", "mountPath": "/kubetune-latency",
                        "hostPath": {"path": "/tmp/kubetune-latency", "type": "DirectoryOrCreate"}}]
    spec["checkpoints"]["uri"] = f"/kubetune-latency/{name}"
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["suspend"] = suspend
    return manifest


class Recorder:
    """Watches one namespace's TrainingJobs and child jobs; remembers when each first reached a state."""

    def __init__(self, api_client, namespace: str, child: tuple[str, str, str]):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.namespace, self.child = namespace, child
        self.created: dict[str, float] = {}                   # TrainingJob -> ADDED seen
        self.created_at: dict[str, float] = {}                # TrainingJob -> creationTimestamp
        self.child_seen: dict[str, float] = {}                # owner -> child ADDED seen
        self.child_created_at: dict[str, float] = {}          # owner -> child creationTimestamp
        self.phase_seen: dict[tuple[str, str], float] = {}    # (TrainingJob, phase) -> seen
        self.first_phase: dict[str, float] = {}               # TrainingJob -> any status.phase seen
        self.stop = threading.Event()
        self.ready = threading.Barrier(3)

    def _follow(self, group, version, plural, on_event):
        from kubernetes import watch

        # One long watch from the current list: no re-list gap in which a creation would be seen late.
        listed = self.custom.list_namespaced_custom_object(group, version, self.namespace, plural)
        stream = watch.Watch()
        self.ready.wait()
        for event in stream.stream(self.custom.list_namespaced_custom_object, group, version, self.namespace, plural,
                                   resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=1800):
            on_event(event["type"], event["object"], time.monotonic())
            if self.stop.is_set():
                stream.stop()

    def start(self) -> None:
        def child(kind, obj, now):
            owner = (obj["metadata"].get("ownerReferences") or [{}])[0].get("name")
            if owner and owner not in self.child_seen:
                self.child_seen[owner] = now
                self.child_created_at[owner] = timestamp(obj["metadata"]["creationTimestamp"])

        def job(kind, obj, now):
            name = obj["metadata"]["name"]
            if kind == "ADDED" and name not in self.created:
                self.created[name] = now
                self.created_at[name] = timestamp(obj["metadata"]["creationTimestamp"])
            phase = (obj.get("status") or {}).get("phase")
            if phase:
                self.phase_seen.setdefault((name, phase), now)
                self.first_phase.setdefault(name, now)

        for args in ((*self.child, child), ("kubetune.dev", "v1alpha1", "trainingjobs", job)):
            threading.Thread(target=self._follow, args=args, daemon=True).start()
        self.ready.wait()


def operator_rss_sampler(stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        for process in psutil.process_iter(["cmdline", "memory_info"]):
            cmdline = process.info["cmdline"] or []
            if "kubetune_operator" in cmdline and process.info["memory_info"]:
                peak[0] = max(peak[0], process.info["memory_info"].rss)
        time.sleep(0.2)


def operator_requests(cluster) -> dict[tuple[str, str], tuple[float, float]]:
    """The operator's own API requests so far, from its /metrics: (verb, resource) -> (count, seconds)."""
    from prometheus_client.parser import text_string_to_metric_families

    pods = yaml.safe_load(cluster.kubectl("get", "pods", "-n", "kubetune-system", "-o", "yaml",
                                          "-l", "app.kubernetes.io/name=kubetune-operator").stdout)["items"]
    pod = next(p for p in pods if p["status"].get("phase") == "Running"
               and any(c["name"] == "operator" for c in p["spec"]["containers"]))
    port = next(port["containerPort"] for c in pod["spec"]["containers"] for port in c.get("ports", [])
                if port.get("name") == "metrics")
    text = urllib.request.urlopen(f"http://{pod['status']['podIP']}:{port}/metrics", timeout=10).read().decode()
    found: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "kubetune_operator_api_request_duration_seconds":
            continue
        for sample in family.samples:
            key = (sample.labels.get("verb", ""), sample.labels.get("resource", ""))
            if sample.name.endswith("_count"):
                found.setdefault(key, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_sum"):
                found.setdefault(key, [0.0, 0.0])[1] = sample.value
    return {key: (count, seconds) for key, (count, seconds) in found.items()}


def print_requests(backend: str, requests: dict[tuple[str, str], tuple[float, float]], jobs: int) -> None:
    total = sum(count for count, _ in requests.values())
    print(f"[{backend}] operator API requests (kopf's own not counted): {total:.0f}, {total / jobs:.2f} per job")
    for (verb, resource), (count, seconds) in sorted(requests.items(), key=lambda item: -item[1][0]):
        print(f"[{backend}]   {verb:6s} {resource:34s} {count / jobs:6.2f} per job   mean {1000 * seconds / max(count, 1):7.1f} ms")


def line(label: str, values: list[float], of: int) -> str:
    if not values:
        return f"{label:44s} none of {of} observed"
    return (f"{label:44s} p50 {statistics.median(values):6.3f} s   p99 {percentile(values, 99):6.3f} s"
            f"   max {max(values):6.3f} s   ({len(values)}/{of})")


def measure(cluster, backend: str, jobs: int, running_jobs: int, data: Path, model: Path, log_to: Path | None,
            apply_processes: int) -> None:
    from kubernetes import config

    from kubetune_operator.backends import BACKENDS as KINDS

    namespace = f"latency-{backend}"
    env = {**os.environ, **cluster.env()}
    earlier_logs = set((cluster.kubelet_state / "pods").glob("kubetune-system_*/logs/operator.log"))
    subprocess.run(["helm", "install", "kubetune", str(REPO / "charts" / "kubetune"), "-n", "kubetune-system",
                    "--create-namespace", "--wait", "--timeout", "180s",
                    "--set", "operator.image.repository=kubetune/operator",
                    "--set", "trainer.image=kubetune/trainer:dev", "--set", f"backend={backend}"],
                   env=env, check=True, capture_output=True)
    try:
        cluster.kubectl("create", "namespace", namespace)
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig()))
        child = KINDS[backend]
        recorder = Recorder(api, namespace, (child.group, child.version, child.plural))
        recorder.start()
        stop, peak = threading.Event(), [0]
        threading.Thread(target=operator_rss_sampler, args=(stop, peak), daemon=True).start()
        time.sleep(2)

        names = [f"lat-{i:04d}" for i in range(jobs)]
        running = [f"run-{i:02d}" for i in range(running_jobs)]
        documents = [yaml.safe_dump(job_manifest(n, namespace, True, str(data), str(model))) for n in names]
        documents += [yaml.safe_dump(job_manifest(n, namespace, False, str(data), str(model))) for n in running]
        applied = time.monotonic()
        # Several kubectl processes at once, each a share of the jobs (interleaved): one kubectl
        # creates its objects one after another, which takes longer than the operator does for them
        # all at thousands of jobs on a busy machine.
        shares = [documents[i::apply_processes] for i in range(apply_processes)]
        appliers = [threading.Thread(target=cluster.kubectl, args=("create", "-f", "-"),
                                     kwargs={"input": "---\n".join(share)}) for share in shares if share]
        for applier in appliers:
            applier.start()
        for applier in appliers:
            applier.join()
        print(f"[{backend}] kubectl create of {len(documents)} TrainingJobs ({len(appliers)} at once) took "
              f"{time.monotonic() - applied:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)

        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and (
                len(recorder.child_seen) < len(documents)
                or sum((n, "Suspended") in recorder.phase_seen for n in names) < len(names)
                or sum((n, "Running") in recorder.phase_seen or (n, "Succeeded") in recorder.phase_seen
                       for n in running) < len(running)):
            time.sleep(0.5)
        stop.set()
        recorder.stop.set()

        everyone = names + running
        created = [recorder.child_seen[n] - recorder.created[n] for n in everyone
                   if n in recorder.child_seen and n in recorder.created]
        by_timestamp = [recorder.child_created_at[n] - recorder.created_at[n] for n in everyone
                        if n in recorder.child_created_at and n in recorder.created_at]
        # The first phase the operator wrote (Suspended, or Pending where the child's own first state
        # was mirrored first); reaching Suspended also waits for the training operator's own work queue.
        phased = [recorder.first_phase[n] - recorder.created[n] for n in names
                  if n in recorder.first_phase and n in recorder.created]
        suspended = [recorder.phase_seen[(n, "Suspended")] - recorder.created[n] for n in names
                     if (n, "Suspended") in recorder.phase_seen and n in recorder.created]
        runs = [min(recorder.phase_seen.get((n, p), float("inf")) for p in ("Running", "Succeeded")) - recorder.created[n]
                for n in running if n in recorder.created]
        runs = [r for r in runs if r != float("inf")]
        print(line(f"[{backend}] created → {child.kind} created", created, len(everyone)))
        print(line(f"[{backend}]   (creationTimestamps, whole seconds)", by_timestamp, len(everyone)))
        print(line(f"[{backend}] created → status.phase written", phased, len(names)))
        print(line(f"[{backend}] created → status.phase Suspended", suspended, len(names)))
        print(line(f"[{backend}] created → status.phase Running", runs, len(running)))
        print(f"[{backend}] operator peak RSS: {peak[0] / 2**20:.0f} MiB")
        print_requests(backend, operator_requests(cluster), len(everyone))
        if log_to:
            logs = sorted(set((cluster.kubelet_state / "pods").glob("kubetune-system_*/logs/operator.log")) - earlier_logs)
            log_to.with_suffix(f".{backend}.log").write_text("".join(p.read_text() for p in logs))
    finally:
        # The jobs go first, while their operator still runs (older operators held finalizers): the next
        # backend's operator must not find them (it would reconcile them, and that would be timed).
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=600s", check=False)
        subprocess.run(["helm", "uninstall", "kubetune", "-n", "kubetune-system", "--wait"], env=env,
                       capture_output=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, action="append",
                        help="measure this backend (repeatable); default: both")
    parser.add_argument("--jobs", type=int, default=200, help="suspended TrainingJobs applied at once")
    parser.add_argument("--running-jobs", type=int, default=5, help="extra jobs that really run (created → Running)")
    parser.add_argument("--apply-processes", type=int, default=8, help="kubectl processes creating the jobs at once")
    parser.add_argument("--operator-log", type=Path, help="copy the operator pod's log here at the end (per backend)")
    args = parser.parse_args(argv)

    from kubetune_dev.cluster import Cluster
    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    # One control plane per machine at a time (pod addresses are not per cluster): wait for the tests'.
    lock_path = Path(os.environ.get("KUBETUNE_CACHE", Path.home() / ".cache" / "kubetune")) / "control-plane.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock, tempfile.TemporaryDirectory(prefix="kubetune-latency-") as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cluster = Cluster(Path(tmp) / "cluster", log=lambda line: None)
        started = time.monotonic()
        cluster.up()
        print(f"control plane up in {time.monotonic() - started:.1f} s")
        try:
            model = write_tiny_model("sd15", Path(tmp) / "model")
            data = write_tiny_data("captions", Path(tmp) / "data", count=4, size=32)
            for backend in args.backend or BACKENDS:
                measure(cluster, backend, args.jobs, args.running_jobs, data, model, args.operator_log,
                        args.apply_processes)
        finally:
            cluster.down()


if __name__ == "__main__":
    sys.exit(main())
