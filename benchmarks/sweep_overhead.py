"""A TrainingSweep's own overhead: the operator's reconcile with many trials recorded, and the time
from one trial's end to the next trial's pods.

    .venv/bin/python benchmarks/sweep_overhead.py                  # both parts
    .venv/bin/python benchmarks/sweep_overhead.py --part reconcile # no control plane: seconds

reconcile: the decision of one sweep step (kubetune_operator.sweep_state.plan) over a status
recording N trials (default 100) of 200 readings each, with the N trial TrainingJobs as the
operator reads them; the median over 50 calls, and the size of the status it writes. (A real step
adds one list of the sweep's TrainingJobs and at most one status patch, timed in the handoff part.)

handoff: brings up its own local control plane (waiting for the tests' lock), installs the chart
(the operator as a pod, the sweep ticking every --sweep-interval seconds) and applies a sweep of
--trials trials of the tiny SD1.5 run one at a time; a watch records when each trial's TrainingJob
is first seen Succeeded and when the next trial's first pod appears. Prints each handoff and the
median (target: at most 5 s).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = {"model": {"family": "sd15", "pretrained": "org/model"}, "data": {"layout": "captions", "uri": "s3://data/set"},
            "training": {"maxSteps": 1000}, "checkpoints": {"uri": "s3://out/runs"}}


def reconcile(trials: int) -> None:
    from kubetune_api.sweep import TrainingSweep
    from kubetune_operator.sweep_state import TrialJob, plan

    spec = TrainingSweep.model_validate({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "big"},
        "spec": {"template": {"spec": TEMPLATE}, "objective": {"metric": "loss"}, "maxTrials": trials + 10,
                 "parallelTrials": 10, "earlyStopping": {"rule": "median", "minSteps": 10},
                 "parameters": {"training.learningRate": {"logUniform": [1e-5, 1e-3]},
                                "adapter.rank": {"choice": [4, 8, 16]}}}}).spec
    status: dict = {}
    for _ in range(trials // 10):  # grow the sweep to N finished trials, ten at a time
        status = plan("big", "ns", spec, status, {}).status
        jobs = {r["number"]: TrialJob(r["number"], r["parameters"], "Succeeded", step=5, loss=0.5)
                for r in status["trials"]}
        for record in status["trials"]:
            record["intermediate"] = {str(s): 1.0 / s for s in range(5, 1005, 5)}
        status = plan("big", "ns", spec, status, jobs).status
    running = {r["number"]: TrialJob(r["number"], r["parameters"], "Running", step=500, loss=0.2)
               for r in status["trials"] if r["state"] == "running"}
    finished = {r["number"]: TrialJob(r["number"], r["parameters"], "Succeeded", step=1000, loss=0.1)
                for r in status["trials"] if r["state"] != "running"}
    jobs = {**finished, **running}
    recorded = sum(r["state"] != "running" for r in status["trials"])
    times = []
    for _ in range(50):
        started = time.perf_counter()
        plan("big", "ns", spec, status, jobs)
        times.append(time.perf_counter() - started)
    size = len(json.dumps(status))
    print(f"reconcile: {recorded} finished trials + {len(running)} running, 200 readings each: "
          f"median {statistics.median(times) * 1000:.1f} ms, max {max(times) * 1000:.1f} ms per step "
          f"(50 steps); status {size / 1024:.0f} KiB")


BUCKET = "sweep-bench"


def upload_inputs(env: dict, tmp: Path) -> dict[str, str]:
    """The tiny SD1.5 and a captions set in the control plane's S3 server (pods see no local files)."""
    import boto3

    from kubetune_trainer.data.tiny_data import write_tiny_data
    from kubetune_trainer.models.tiny_models import write_tiny_model

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_DEFAULT_REGION"],
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=BUCKET)
    for local, prefix in ((write_tiny_model("sd15", tmp / "model"), "model"),
                          (write_tiny_data("captions", tmp / "data", count=4, size=32), "data")):
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local)}")
    return {"model": f"s3://{BUCKET}/model", "data": f"s3://{BUCKET}/data"}


def handoff(trials: int, sweep_interval: float) -> None:
    from kubernetes import client, config, watch

    from kubetune_dev.cluster import Cluster

    lock_path = Path(os.environ.get("KUBETUNE_CACHE", Path.home() / ".cache" / "kubetune")) / "control-plane.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock, tempfile.TemporaryDirectory(prefix="kubetune-sweep-bench-") as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cluster = Cluster(Path(tmp) / "cluster", log=lambda line: None)
        cluster.up()
        try:
            env = {**os.environ, **cluster.env()}
            inputs = upload_inputs(cluster.env(), Path(tmp))
            installed = subprocess.run(
                ["helm", "install", "kubetune", str(REPO / "charts" / "kubetune"), "-n", "kubetune-system",
                 "--create-namespace", "--wait", "--timeout", "180s", "--set", "operator.image.repository=kubetune/operator",
                 "--set", "trainer.image=kubetune/trainer:dev", "--set", "operator.progressIntervalSeconds=1",
                 "--set", f"s3.endpointUrl={env['AWS_ENDPOINT_URL']}", "--set-string", "s3.pathStyle=true",
                 "--set", f"s3.region={env['AWS_DEFAULT_REGION']}",
                 "--set-json", f"operator.sweepIntervalSeconds={sweep_interval}"], env=env, capture_output=True, text=True)
            if installed.returncode:
                sys.exit(f"helm install failed: {installed.stderr}")
            cluster.kubectl("create", "namespace", "bench")
            cluster.kubectl("create", "secret", "generic", "s3-credentials", "-n", "bench",
                            f"--from-literal=AWS_ACCESS_KEY_ID={env['AWS_ACCESS_KEY_ID']}",
                            f"--from-literal=AWS_SECRET_ACCESS_KEY={env['AWS_SECRET_ACCESS_KEY']}")
            api = config.new_client_from_config(config_file=str(cluster.kubeconfig()))
            succeeded: dict[str, float] = {}
            first_pod: dict[str, float] = {}
            stop = threading.Event()

            def follow_jobs():
                for event in watch.Watch().stream(client.CustomObjectsApi(api).list_namespaced_custom_object,
                                                  "kubetune.dev", "v1alpha1", "bench", "trainingjobs", timeout_seconds=900):
                    job = event["object"]
                    if (job.get("status") or {}).get("phase") == "Succeeded":
                        succeeded.setdefault(job["metadata"]["name"], time.monotonic())
                    if stop.is_set():
                        return

            def follow_pods():
                for event in watch.Watch().stream(client.CoreV1Api(api).list_namespaced_pod, "bench",
                                                  timeout_seconds=900):
                    job = (event["object"].metadata.labels or {}).get("kubetune.dev/trainingjob")
                    if job:
                        first_pod.setdefault(job, time.monotonic())
                    if stop.is_set():
                        return

            for follow in (follow_jobs, follow_pods):
                threading.Thread(target=follow, daemon=True).start()
            template = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())["spec"]
            template["model"]["pretrained"] = inputs["model"]
            template["data"].update(uri=inputs["data"], resolution=32)
            template["training"].update(maxSteps=8, batchSize=2, mixedPrecision="no")
            template["checkpoints"].update(uri=f"s3://{BUCKET}/runs", everySteps=100)
            template["resources"] = {"nodes": 1, "gpusPerNode": 0}
            template["s3"] = {"credentialsSecret": "s3-credentials"}
            template.pop("volumes")  # inputs and runs in S3: no claim to mount
            sweep = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep",
                     "metadata": {"name": "handoff", "namespace": "bench"},
                     "spec": {"template": {"spec": template}, "objective": {"metric": "loss"},
                              "parameters": {"training.learningRate": {"logUniform": [1e-4, 1e-3]}},
                              "maxTrials": trials, "parallelTrials": 1}}
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(sweep))
            names = [f"handoff-{i}" for i in range(trials)]
            deadline = time.monotonic() + 300 * trials
            while time.monotonic() < deadline and not all(n in succeeded for n in names):
                time.sleep(0.5)
            stop.set()
            gaps = [first_pod[b] - succeeded[a] for a, b in zip(names, names[1:]) if a in succeeded and b in first_pod]
            for (a, b), gap in zip(zip(names, names[1:]), gaps):
                print(f"handoff: {a} Succeeded -> {b}'s first pod: {gap:.2f} s")
            if gaps:
                print(f"handoff: median {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s over {len(gaps)} "
                      f"handoffs (sweep step every {sweep_interval} s, progress read every 1 s)")
            else:
                print(f"handoff: no trial finished (seen Succeeded: {sorted(succeeded)})")
            cluster.kubectl("delete", "namespace", "bench", "--wait=true", "--timeout=300s", check=False)
            subprocess.run(["helm", "uninstall", "kubetune", "-n", "kubetune-system", "--wait"], env=env,
                           capture_output=True)
        finally:
            cluster.down()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["reconcile", "handoff", "both"], default="both")
    parser.add_argument("--recorded-trials", type=int, default=100)
    parser.add_argument("--trials", type=int, default=4, help="trials of the handoff sweep (one at a time)")
    parser.add_argument("--sweep-interval", type=float, default=2.0, help="the chart's operator.sweepIntervalSeconds")
    args = parser.parse_args(argv)
    if args.part in ("reconcile", "both"):
        reconcile(args.recorded_trials)
    if args.part in ("handoff", "both"):
        handoff(args.trials, args.sweep_interval)


if __name__ == "__main__":
    sys.exit(main())
