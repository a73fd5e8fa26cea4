"""The operator's own metrics: TrainingJobs by phase, admission rejections, reconcile results."""
from __future__ import annotations

import copy
import uuid

import kopf
import pytest
from kubernetes.client.rest import ApiException
from prometheus_client import REGISTRY, generate_latest

from kubetune_operator import handlers, kube, metrics, reconcile
from kubetune_operator.decision import Observed
from kubetune_operator.metrics import PhaseCounts
from kubetune_operator.status import PHASES


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def trainingjob(phase: str | None = None, deleting: bool = False, spec: dict | None = None) -> kopf.Body:
    metadata = {"name": "tj", "namespace": "team-a", "uid": str(uuid.uuid4())}
    if deleting:
        metadata["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return kopf.Body({"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": metadata,
                      "spec": spec or {}, "status": {"phase": phase} if phase else {}})


# ---- kubetune_operator_trainingjobs{phase} ------------------------------------------------------

def test_every_phase_is_exported_at_zero_when_there_are_no_jobs():
    assert PhaseCounts().counts() == {phase: 0 for phase in PHASES}


def test_a_new_job_counts_as_pending_until_its_first_reconcile():
    counts = PhaseCounts()
    counts.observe("a", None)
    assert counts.counts()["Pending"] == 1


def test_a_phase_change_moves_the_job_rather_than_adding_it_twice():
    counts = PhaseCounts()
    for phase in ("Pending", "Running", "Running", "Succeeded"):
        counts.observe("a", phase)
    counts.observe("b", "Running")
    assert counts.counts() == {**{p: 0 for p in PHASES}, "Succeeded": 1, "Running": 1}


def test_a_job_leaves_the_count_when_its_deletion_starts_or_it_is_gone():
    counts = PhaseCounts()
    counts.observe("a", "Running")
    counts.observe("b", "Failed")
    counts.observe("a", "Running", deleting=True)
    counts.observe("b", None, deleting=True)
    counts.observe("never-seen", None, deleting=True)
    assert sum(counts.counts().values()) == 0


def test_an_unknown_phase_never_becomes_a_label():
    counts = PhaseCounts()
    counts.observe("a", "Exploded")
    assert set(counts.counts()) == set(PHASES) and sum(counts.counts().values()) == 0


def test_a_restarted_operator_recounts_from_the_initial_listing():
    """A new process starts empty; kopf delivers every existing object once (type None)."""
    before = PhaseCounts()
    for uid, phase in [("a", "Running"), ("b", "Running"), ("c", "Succeeded")]:
        before.observe(uid, phase)
    after = PhaseCounts()
    for uid, phase in [("a", "Running"), ("c", "Succeeded")]:  # b was deleted while no operator ran
        after.observe(uid, phase)
    assert after.counts()["Running"] == 1 and after.counts()["Succeeded"] == 1


def test_the_handler_follows_creation_phase_changes_and_deletion():
    job = trainingjob()
    uid = job.metadata.uid

    def seen(phase):
        return value("kubetune_operator_trainingjobs", phase=phase)

    start = {phase: seen(phase) for phase in PHASES}
    handlers.count_by_phase(type=None, body=job, uid=uid)
    assert seen("Pending") == start["Pending"] + 1
    running = trainingjob("Running")
    handlers.count_by_phase(type="MODIFIED", body=running, uid=uid)
    assert (seen("Pending"), seen("Running")) == (start["Pending"], start["Running"] + 1)
    handlers.count_by_phase(type="MODIFIED", body=trainingjob("Running", deleting=True), uid=uid)
    assert seen("Running") == start["Running"]
    handlers.count_by_phase(type="MODIFIED", body=running, uid=uid)
    handlers.count_by_phase(type="DELETED", body=running, uid=uid)
    assert {phase: seen(phase) for phase in PHASES} == start


def test_the_exposition_names_every_phase_and_every_rejection_reason():
    text = generate_latest(REGISTRY).decode()
    for phase in PHASES:
        assert f'kubetune_operator_trainingjobs{{phase="{phase}"}}' in text
    for reason in metrics.ADMISSION_REASONS:
        assert f'kubetune_operator_admission_rejections_total{{reason="{reason}"}}' in text
    for result in metrics.RECONCILE_RESULTS:
        assert f'kubetune_operator_reconciles_total{{result="{result}"}}' in text


# ---- kubetune_operator_admission_rejections_total{reason} ---------------------------------------

@pytest.fixture
def valid_body(example_manifest) -> kopf.Body:
    manifest = copy.deepcopy(example_manifest)
    manifest["metadata"]["namespace"] = "team-a"
    return kopf.Body(manifest)


def test_an_invalid_spec_is_refused_and_counted(valid_body):
    body = copy.deepcopy(dict(valid_body))
    body["spec"]["training"]["maxSteps"] = -1
    before = value("kubetune_operator_admission_rejections_total", reason="invalid_spec")
    with pytest.raises(kopf.AdmissionError, match="maxSteps"):
        handlers.validate_new_job(body=kopf.Body(body), warnings=[])
    assert value("kubetune_operator_admission_rejections_total", reason="invalid_spec") == before + 1


def test_a_queue_named_two_ways_that_disagree_is_refused_and_counted(valid_body):
    body = copy.deepcopy(dict(valid_body))
    body["spec"].setdefault("scheduling", {})["queueName"] = "jobs"
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "other"}
    before = value("kubetune_operator_admission_rejections_total", reason="queue")
    with pytest.raises(kopf.AdmissionError, match="same request"):
        handlers.validate_new_job(body=kopf.Body(body), warnings=[])
    assert value("kubetune_operator_admission_rejections_total", reason="queue") == before + 1


def test_an_accepted_job_counts_no_rejection(valid_body):
    before = {r: value("kubetune_operator_admission_rejections_total", reason=r) for r in metrics.ADMISSION_REASONS}
    handlers.validate_new_job(body=valid_body, warnings=[])
    assert {r: value("kubetune_operator_admission_rejections_total", reason=r)
            for r in metrics.ADMISSION_REASONS} == before


# ---- kubetune_operator_reconciles_total{result} -------------------------------------------------

def raising(error):
    def decided_or_raised(*_):
        raise error
    return decided_or_raised


@pytest.mark.parametrize("outcome,result", [
    (None, "ok"),
    (kopf.TemporaryError("not there yet", delay=15), "retry"),
    (ApiException(status=500, reason="Internal Server Error"), "error"),
    (RuntimeError("a bug"), "error"),
], ids=["ok", "temporary", "api-error", "bug"])
def test_every_reconcile_outcome_is_counted(monkeypatch, outcome, result):
    monkeypatch.setattr(reconcile, "_reconcile", (lambda *_: None) if outcome is None else raising(outcome))
    before = value("kubetune_operator_reconciles_total", result=result)
    durations = value("kubetune_operator_reconcile_duration_seconds_count")
    if outcome is None:
        reconcile.reconcile("team-a", "tj")
    else:
        with pytest.raises(type(outcome)):
            reconcile.reconcile("team-a", "tj")
    assert value("kubetune_operator_reconciles_total", result=result) == before + 1
    assert value("kubetune_operator_reconcile_duration_seconds_count") == durations + 1


def test_an_invalid_spec_fails_the_real_reconcile_and_counts_an_error(monkeypatch):
    body = dict(trainingjob(spec={"training": {"maxSteps": -1}}))
    body["metadata"]["resourceVersion"] = "1"
    monkeypatch.setattr(kube, "read_training_job", lambda namespace, name: body)
    monkeypatch.setattr(reconcile, "observe", lambda job, settings, *_: Observed(
        name="tj", namespace="team-a", uid="u", generation=1, settings=settings, now="now"))
    before = value("kubetune_operator_reconciles_total", result="error")
    with pytest.raises(kopf.PermanentError, match="invalid spec"):
        reconcile.reconcile("team-a", "tj")
    assert value("kubetune_operator_reconciles_total", result="error") == before + 1


# ---- where Prometheus finds the trainer ---------------------------------------------------------

def test_only_the_master_pod_which_runs_rank_0_is_annotated_for_scraping(example_manifest):
    from kubetune_api.manifest import parse_manifest
    from kubetune_operator.backends import PyTorchJobBackend
    from kubetune_operator.settings import Settings

    manifest = copy.deepcopy(example_manifest)
    manifest["spec"]["resources"]["nodes"] = 3
    child = PyTorchJobBackend().build(parse_manifest(manifest), "uid", Settings(trainer_metrics_port=9555))
    replicas = child["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9555", "prometheus.io/path": "/metrics"}
    assert "annotations" not in replicas["Worker"]["template"]["metadata"]
    ports = {p["name"]: p["containerPort"] for p in replicas["Master"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == 9555  # the PodMonitor's port name
