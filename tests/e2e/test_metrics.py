"""Metrics end to end: the local Prometheus scrapes the operator and a training run (found through
the pods' prometheus.io annotations), and every query of the shipped Grafana dashboard returns
data for that run.

One run per backend serves every test here (a module fixture); the tests then ask Prometheus
about the time it took, so they read what a dashboard opened after the run would show.
"""
from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from kubetune_api.ports import free_listen_port
from tests import dashboards
from tests.e2e.conftest import delete_namespace_and_wait
from tests.e2e.jobs import (OPERATOR_NAMESPACE, backend_of, example_job, get_job, kubectl, operator_log, phase,
                            rank0_pod)
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e
JOB = "metrics-run"
# Long enough that Prometheus scrapes rank 0 several times while it trains: a new pod is found up to
# 5 s after it starts (Prometheus batches discovery updates), and rate() over 10 s needs two scrapes
# with progress between them. 60 steps (about 5 s on CI) once left the ratio panels without data.
# The length comes from a checkpoint after every step (save and S3 upload, about 0.5 s on an idle
# machine, so 40 steps train for about 20 s) rather than from more steps: a step costs 0.12 s idle
# but several seconds beside the other pytest worker, a checkpoint hardly more. (240 steps with a
# checkpoint every 20 took 9 minutes per backend in CI.) Every scrape interval also sees a new
# checkpoint, so the checkpoint panels' rates always have one.
MAX_STEPS, CHECKPOINT_EVERY = 40, 1
# What Grafana's $__rate_interval becomes for the devcluster's 2 s scrape interval (4 scrapes, plus one).
RATE_INTERVAL = "10s"


class Prometheus:
    """The few calls of Prometheus's HTTP API these tests need."""

    def __init__(self, url: str):
        self.url = url

    def _get(self, path: str, **params) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self._get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an instant query, or None when it has no series."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} has {len(result)} series: {result}"
        return float(result[0]["value"][1]) if result else None

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self._get(f"/api/v1/label/{label}/values", **{"match[]": match})

    def targets(self) -> list[dict]:
        return self._get("/api/v1/targets", state="active")["activeTargets"]


def finite_values(series: list[dict]) -> list[float]:
    return [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]


class DcgmStandIn:
    """What the NVIDIA DCGM exporter would report for the run's GPU, served for Prometheus.

    The real exporter needs a GPU and its driver; this serves the two series the dashboard reads,
    with the labels the exporter puts on them in Kubernetes mode (the pod and namespace holding the
    GPU), so the dashboard's join of GPU series to the run's pods is tested against a real
    Prometheus. Everything else in these tests is the real component.
    """

    def __init__(self, targets_dir, namespace: str, pod: str, container: str):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        registry = CollectorRegistry()
        labels = {"gpu": "0", "UUID": "GPU-00000000-0000-0000-0000-000000000000", "device": "nvidia0",
                  "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-1", "container": container,
                  "namespace": namespace, "pod": pod}
        for name, text, value in [("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", 87),
                                  ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", 40960)]:
            Gauge(name, text, list(labels), registry=registry).labels(**labels).set(value)
        port = free_listen_port()
        self.server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
        self.target_file = targets_dir / "dcgm-stand-in.json"
        self.target_file.write_text(json.dumps([{"targets": [f"127.0.0.1:{port}"],
                                                 "labels": {"exporter": "dcgm-stand-in"}}]))

    def close(self) -> None:
        self.target_file.unlink(missing_ok=True)
        self.server.shutdown()


@pytest.fixture(scope="module")
def prometheus(control_plane) -> Prometheus:
    return Prometheus(control_plane.env()["PROMETHEUS_URL"])


def operator_pod(core) -> str:
    pods = core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/name=kubetune-operator")
    running = [p.metadata.name for p in pods.items
               if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
    return running[0] if len(running) == 1 else None


@pytest.fixture(scope="module")
def job_namespace_for_module(control_plane, core, backend):
    """The run's namespace with its S3 credentials Secret; one for the module's run per backend."""
    env = control_plane.env()
    namespace = f"e2e-metrics-{backend}"
    core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-credentials"}, "stringData": {
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"]}})
    yield namespace
    delete_namespace_and_wait(core, namespace)


@pytest.fixture(scope="module")
def run(control_plane, api_client, core, backend, operator_release, job_namespace_for_module, inputs_in_s3,
        prometheus):
    """One training run with checkpoints to S3, from the moment before it was applied to its end."""
    namespace, dcgm = job_namespace_for_module, None
    try:
        # Prometheus scrapes the operator before anything happens (so counters have a baseline).
        eventually(lambda: operator_pod(core) and prometheus.query(
            f'kubetune_operator_reconciles_total{{pod="{operator_pod(core)}"}}'), timeout=120, interval=1,
            message="the operator's first scrape")
        started = time.time()
        # One refusal by the webhook. Its failurePolicy is Ignore, so until kopf has registered it
        # a server-side dry run is admitted (and counted nowhere): try until the first refusal.
        refused = example_job(inputs_in_s3, "refused", "runs/refused")
        refused["metadata"].setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = "other"
        refused["spec"]["scheduling"] = {**refused["spec"].get("scheduling", {}), "queueName": "jobs"}
        eventually(lambda: "same request" in kubectl(
            control_plane, "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(refused),
            check=False).stderr, timeout=120, interval=1, message="the webhook refusing a queue named two ways")

        manifest = example_job(inputs_in_s3, JOB, f"runs/{JOB}", maxSteps=MAX_STEPS)
        manifest["spec"]["checkpoints"].update(everySteps=CHECKPOINT_EVERY, keepLast=2)
        kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
        # The GPU of rank 0's pod, as DCGM would report it (a TrainJob's pod gets its name only now).
        pod = eventually(lambda: rank0_pod(core, backend, namespace, JOB), timeout=120, interval=0.5,
                         message="rank 0's pod")
        dcgm = DcgmStandIn(control_plane.prometheus_targets, namespace, pod, backend_of(backend).container)
        final = eventually(lambda: phase(api_client, namespace, JOB) in ("Succeeded", "Failed")
                           and get_job(api_client, namespace, JOB), timeout=900, interval=2,
                           message=lambda: "the run finished; operator log:\n" + operator_log(control_plane, core))
        logs = control_plane.pod_log(pod, namespace, backend_of(backend).container).read_text()
        assert final["status"]["phase"] == "Succeeded", logs[-3000:]
        time.sleep(5)  # two more scrapes of the operator, which saw the end
        yield {"start": started, "end": time.time(), "operator_pod": operator_pod(core), "namespace": namespace,
               "pod": pod, "kind": backend_of(backend).kind}
    finally:
        if dcgm:
            dcgm.close()


def test_prometheus_scraped_the_operator_and_the_runs_rank_0_pod(prometheus, run):
    operator = f'up{{namespace="{OPERATOR_NAMESPACE}", pod="{run["operator_pod"]}"}}'
    rank0 = f'up{{namespace="{run["namespace"]}", pod="{run["pod"]}"}}'
    for expr in (operator, rank0):
        series = prometheus.query_range(expr, run["start"], run["end"])
        assert series and max(finite_values(series)) == 1, f"{expr} was never up: {series}"
    # The target came from the pod's annotations, at the annotated path.
    scraped = {t["labels"].get("pod"): t for t in prometheus.targets()}
    assert scraped[run["operator_pod"]]["scrapeUrl"].endswith(":9090/metrics")
    assert scraped[run["operator_pod"]]["health"] == "up"


def test_every_dashboard_query_returns_data_for_the_run(prometheus, run):
    variables = {"namespace": run["namespace"], "trainingjob": JOB}
    builtins = {**dashboards.BUILTINS, "__rate_interval": RATE_INTERVAL}
    queries = dashboards.queries(dashboards.load())
    empty = {}
    for query in queries:
        expr = dashboards.substitute(query.expr, variables, builtins)
        values = finite_values(prometheus.query_range(expr, run["start"], run["end"]))
        if not values:
            empty[query.where] = expr
    assert not empty, "queries without a finite value during the run:\n" + "\n".join(
        f"{where}: {expr}" for where, expr in empty.items())
    # The variables offer this run.
    assert run["namespace"] in prometheus.label_values("trainingjob_namespace", "kubetune_trainer_step")
    assert JOB in prometheus.label_values("trainingjob",
                                          f'kubetune_trainer_step{{trainingjob_namespace="{run["namespace"]}"}}')


def test_the_gpu_panels_join_dcgm_series_to_the_runs_pods(prometheus, run):
    panel = next(p for p in dashboards.panels(dashboards.load()) if p["title"] == "GPU utilisation (DCGM)")
    expr = dashboards.substitute(panel["targets"][0]["expr"], {"namespace": run["namespace"], "trainingjob": JOB})
    series = prometheus.query_range(expr, run["start"], run["end"])
    assert {s["metric"]["pod"] for s in series} == {run["pod"]}
    assert {s["metric"]["trainingjob"] for s in series} == {JOB} and finite_values(series)[-1] == 87
    # Another job's name selects nothing: the join filters, it does not just pass DCGM through.
    other = dashboards.substitute(panel["targets"][0]["expr"], {"namespace": run["namespace"],
                                                                 "trainingjob": "not-this-one"})
    assert prometheus.query_range(other, run["start"], run["end"]) == []


def test_the_trainer_reported_its_checkpoints_and_steps(prometheus, run):
    selector = f'trainingjob_namespace="{run["namespace"]}", trainingjob="{JOB}"'

    def last(expr):
        return finite_values(prometheus.query_range(expr, run["start"], run["end"]))[-1]

    assert last(f"max(kubetune_trainer_planned_steps{{{selector}}})") == MAX_STEPS
    assert 0 < last(f"max(kubetune_trainer_step{{{selector}}})") <= MAX_STEPS
    assert last(f"max(kubetune_trainer_checkpoint_upload_duration_seconds_count{{{selector}}})") >= 1
    assert last(f"max(kubetune_trainer_checkpoint_uploaded_bytes_total{{{selector}}})") > 0
    assert last(f'max(kubetune_trainer_pod_info{{{selector}, trainer_pod="{run["pod"]}", node_rank="0"}})') == 1


def test_the_refused_apply_was_counted_by_reason(prometheus, run):
    pod = run["operator_pod"]
    assert prometheus.value(f'kubetune_operator_admission_rejections_total{{reason="queue", pod="{pod}"}}') == 1
    assert prometheus.value(f'kubetune_operator_admission_rejections_total{{reason="invalid_spec", pod="{pod}"}}') == 0
    assert prometheus.value(f'kubetune_operator_child_jobs_created_total{{kind="{run["kind"]}", pod="{pod}"}}') == 1
    assert prometheus.value(f'kubetune_operator_reconciles_total{{result="ok", pod="{pod}"}}') >= 1


def test_trainingjobs_by_phase_follow_the_run_a_restart_of_the_operator_and_the_deletion(
        control_plane, core, prometheus, run):
    def by_phase(pod: str, phase: str, at_range: bool = False):
        expr = f'kubetune_operator_trainingjobs{{phase="{phase}", pod="{pod}"}}'
        return finite_values(prometheus.query_range(expr, run["start"], run["end"])) if at_range else prometheus.value(expr)

    first = run["operator_pod"]
    # During the run the job was counted Running (and no refused job was ever counted).
    assert max(by_phase(first, "Running", at_range=True)) == 1
    assert max(by_phase(first, "Pending", at_range=True)) <= 1
    assert by_phase(first, "Succeeded") == 1 and by_phase(first, "Running") == 0

    # A new operator process counts the existing job again, from kopf's initial listing.
    kubectl(control_plane, "delete", "pod", "-n", OPERATOR_NAMESPACE, first, "--wait=false")
    second = eventually(lambda: (pod := operator_pod(core)) and pod != first and pod, timeout=180, interval=1,
                        message="a new operator pod")
    eventually(lambda: by_phase(second, "Succeeded") == 1, timeout=180, interval=1,
               message=lambda: "the restarted operator's count; operator log:\n" + operator_log(control_plane, core))
    assert all(by_phase(second, p) == 0 for p in ("Pending", "Running", "Failed", "Suspended"))

    # Deleting the job removes it from the count.
    kubectl(control_plane, "delete", "tj", JOB, "-n", run["namespace"], "--wait=true", "--timeout=120s")
    eventually(lambda: by_phase(second, "Succeeded") == 0, timeout=60, interval=1, message="the deleted job uncounted")
