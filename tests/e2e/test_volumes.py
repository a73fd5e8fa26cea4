"""spec.volumes on the dev cluster: a job whose model and data are on one PersistentVolumeClaim and whose
checkpoints go to another, as clusters keep them (NFS, Lustre, Filestore behind a claim).

The dev cluster's storage is this machine's disk: each PersistentVolume is a hostPath, bound to its claim
by kube-controller-manager's binder, and the process kubelet mounts it (read-only where the job says so).
"""
from __future__ import annotations

import re

import pytest
import yaml

from kubetune_trainer.data.tiny_data import write_tiny_data
from kubetune_trainer.models.tiny_models import write_tiny_model
from tests.conftest import REPO
from tests.e2e.jobs import get_job, kubectl, operator_log, phase, rank0_pod, rank0_pod_logs
from tests.e2e.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("backend", ["trainjob"], indirect=True)]

# Enough steps that the pod is still training when its deletion reaches it (~7 steps a second here).
NAME, STEPS, EVERY = "on-claims", 120, 10
STORAGE_CLASS = "e2e-host-disk"


def persistent_volume(core, name: str, path, namespace: str, claim: str) -> None:
    """A hostPath PersistentVolume reserved for CLAIM (a claim made later binds to it)."""
    core.create_persistent_volume({"metadata": {"name": name}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "persistentVolumeReclaimPolicy": "Retain",
        "storageClassName": STORAGE_CLASS, "hostPath": {"path": str(path), "type": "Directory"},
        "claimRef": {"namespace": namespace, "name": claim}}})


def persistent_volume_claim(core, namespace: str, name: str) -> None:
    core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": name}, "spec": {
        "accessModes": ["ReadWriteMany"], "storageClassName": STORAGE_CLASS,
        "resources": {"requests": {"storage": "1Gi"}}}})


def condition(api_client, namespace: str, kind: str) -> dict:
    conditions = (get_job(api_client, namespace, NAME).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def step_of(api_client, namespace: str) -> int:
    return ((get_job(api_client, namespace, NAME).get("status") or {}).get("progress") or {}).get("step", 0)


def test_a_job_on_two_claims_waits_for_the_missing_one_then_trains_loses_its_pod_and_resumes_from_its_claim(
        control_plane, api_client, core, backend, operator_release, namespace, tmp_path):
    """Over a minute: a run that waits for a claim, starts, loses its pod past a checkpoint and resumes to the end."""
    inputs, runs = tmp_path / "inputs", tmp_path / "runs"
    write_tiny_model("sd15", inputs / "models" / "sd15")
    write_tiny_data("captions", inputs / "data" / "shapes", count=8, size=32)
    runs.mkdir()
    written = {p: p.stat().st_mtime_ns for p in inputs.rglob("*")}
    volumes = {f"{namespace}-inputs": (inputs, "inputs"), f"{namespace}-runs": (runs, "runs")}
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["metadata"]["name"] = NAME
    spec = manifest["spec"]
    spec["model"]["pretrained"] = "/inputs/models/sd15"
    spec["data"].update(uri="/inputs/data/shapes", resolution=32)
    spec["training"].update({"maxSteps": STEPS, "batchSize": 2, "mixedPrecision": "no", "lrWarmupSteps": 0})
    spec["validation"] = {}
    spec["checkpoints"].update(uri="/runs", everySteps=EVERY)
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["volumes"] = [
        {"name": "inputs", "mountPath": "/inputs", "readOnly": True, "persistentVolumeClaim": {"claimName": "inputs"}},
        {"name": "runs", "mountPath": "/runs", "persistentVolumeClaim": {"claimName": "runs"}}]
    try:
        for volume, (path, claim) in volumes.items():
            persistent_volume(core, volume, path, namespace, claim)
        persistent_volume_claim(core, namespace, "inputs")
        kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

        # The checkpoints' claim does not exist yet: the job waits, saying which volume and how to fix it.
        waiting = eventually(lambda: condition(api_client, namespace, "VolumesReady").get("status") == "False"
                             and condition(api_client, namespace, "VolumesReady"), timeout=120, interval=1,
                             message=lambda: f"VolumesReady=False; operator log:\n{operator_log(control_plane, core)}")
        assert waiting["reason"] == "ClaimNotFound"
        assert waiting["message"].startswith("spec.volumes[runs].persistentVolumeClaim.claimName: "
                                             f"PersistentVolumeClaim 'runs' does not exist in namespace '{namespace}'")
        assert phase(api_client, namespace, NAME) != "Failed"

        # Once it exists and is bound, the job starts; its pod is lost past a checkpoint and the run resumes.
        persistent_volume_claim(core, namespace, "runs")
        seen = eventually(lambda: step_of(api_client, namespace) >= EVERY + 2 and step_of(api_client, namespace),
                          timeout=300, interval=0.5, message=lambda: f"training; {operator_log(control_plane, core)}")
        core.delete_namespaced_pod(rank0_pod(core, backend, namespace, NAME), namespace)
        eventually(lambda: phase(api_client, namespace, NAME) in ("Succeeded", "Failed"), timeout=300, interval=2,
                   message=lambda: f"finished; operator log:\n{operator_log(control_plane, core)}")
        logs = rank0_pod_logs(control_plane, backend, namespace, NAME)
        assert phase(api_client, namespace, NAME) == "Succeeded", logs[-1][-3000:]
        assert condition(api_client, namespace, "VolumesReady")["status"] == "True"

        run = runs / namespace / NAME / "v0"
        resumed = re.search(rf"resumed from {re.escape(str('/runs' / run.relative_to(runs)))}/checkpoint-(\d+) "
                            r"at step (\d+)", logs[-1])
        assert len(logs) == 2 and resumed, [log[-1500:] for log in logs]
        assert seen <= int(resumed.group(2)) < STEPS, "the last checkpoint, taken on SIGTERM, on the claim"
        assert (run / "pytorch_lora_weights.safetensors").is_file(), sorted(p.name for p in run.iterdir())
        assert {p: p.stat().st_mtime_ns for p in inputs.rglob("*")} == written, "the read-only claim is as it was"
    finally:
        kubectl(control_plane, "delete", "tj", NAME, "-n", namespace, "--ignore-not-found", "--wait=true")
        for volume in volumes:
            core.delete_persistent_volume(volume)
