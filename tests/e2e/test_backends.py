"""A backend that is not there yet: the TrainingJob is admitted, says what is missing and how to get
it (a BackendReady condition and a Warning event), and starts once the piece is installed.

(A cluster without the TrainJob CRD is the unit tests' case, test_operator_handlers: the CRDs of this
control plane are shared by every test and cannot come and go.)
"""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.conftest import REPO
from tests.e2e.jobs import OPERATOR_NAMESPACE, example_job, get_child, get_job, kubectl, operator_log, os_env, phase
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e


def helm_upgrade(control_plane, *settings: str) -> None:
    upgraded = subprocess.run(["helm", "upgrade", "kubetune", str(REPO / "charts" / "kubetune"), "-n",
                               OPERATOR_NAMESPACE, "--reuse-values", "--wait", "--timeout", "180s", *settings],
                              env={**os_env(), **control_plane.env()}, capture_output=True, text=True)
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr


def backend_ready(api_client, namespace: str, name: str) -> dict | None:
    conditions = (get_job(api_client, namespace, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "BackendReady"), None)


def warnings_for(control_plane, namespace: str, name: str) -> list[dict]:
    return json.loads(kubectl(control_plane, "get", "events", "-n", namespace, "--field-selector",
                              f"involvedObject.name={name},involvedObject.kind=TrainingJob,type=Warning",
                              "-o", "json").stdout)["items"]


def wait_until_succeeded(api_client, core, control_plane, namespace: str, name: str) -> dict:
    final = eventually(lambda: phase(api_client, namespace, name) in ("Succeeded", "Failed")
                       and get_job(api_client, namespace, name), timeout=600, interval=2,
                       message=lambda: f"{name} finished; operator log:\n" + operator_log(control_plane, core))
    assert final["status"]["phase"] == "Succeeded", final["status"]
    return final


@pytest.mark.parametrize("backend", ["pytorchjob"], indirect=True)
def test_a_job_asking_for_a_backend_not_enabled_waits_and_starts_once_it_is(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3):
    manifest = example_job(inputs_in_s3, "wants-trainjob", "runs/wants-trainjob", maxSteps=2)
    manifest["spec"]["backend"] = "trainjob"
    applied = kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    assert "installed without the trainjob backend" in applied.stderr, "kubectl apply shows the admission warning"

    condition = eventually(lambda: backend_ready(api_client, job_namespace, "wants-trainjob"), timeout=60,
                           message=lambda: "BackendReady; operator log:\n" + operator_log(control_plane, core))
    assert (condition["status"], condition["reason"]) == ("False", "BackendNotEnabled")
    assert "helm upgrade kubetune charts/kubetune --reuse-values --set trainjob.enabled=true" in condition["message"]
    assert phase(api_client, job_namespace, "wants-trainjob") == "Pending"
    assert [e["reason"] for e in warnings_for(control_plane, job_namespace, "wants-trainjob")] == ["BackendNotEnabled"]

    helm_upgrade(control_plane, "--set", "trainjob.enabled=true")  # the operator restarts with both backends
    final = wait_until_succeeded(api_client, core, control_plane, job_namespace, "wants-trainjob")
    assert final["status"]["backend"] == "trainjob"
    assert get_child(api_client, "trainjob", job_namespace, "wants-trainjob") is not None
    assert backend_ready(api_client, job_namespace, "wants-trainjob")["status"] == "True"


@pytest.mark.parametrize("backend", ["trainjob"], indirect=True)
def test_a_missing_training_runtime_is_reported_and_the_job_starts_once_it_is_there(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3):
    helm_upgrade(control_plane, "--set", "trainjob.runtime.create=false")  # the runtime is gone
    manifest = example_job(inputs_in_s3, "no-runtime", "runs/no-runtime", maxSteps=2)
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    condition = eventually(lambda: backend_ready(api_client, job_namespace, "no-runtime"), timeout=60,
                           message=lambda: "BackendReady; operator log:\n" + operator_log(control_plane, core))
    assert (condition["status"], condition["reason"]) == ("False", "TrainingRuntimeMissing")
    assert condition["message"].startswith("ClusterTrainingRuntime 'kubetune-trainer' does not exist")
    assert get_child(api_client, backend, job_namespace, "no-runtime") is None
    assert [e["reason"] for e in warnings_for(control_plane, job_namespace, "no-runtime")] == ["TrainingRuntimeMissing"]

    helm_upgrade(control_plane, "--set", "trainjob.runtime.create=true")
    wait_until_succeeded(api_client, core, control_plane, job_namespace, "no-runtime")
    assert backend_ready(api_client, job_namespace, "no-runtime")["reason"] == "ChildCreated"
