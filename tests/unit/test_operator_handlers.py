"""The handlers' glue, against an in-memory stand-in for the API server's custom objects: a backend
that is not installed is reported and waited for, the final status is written once, a poll never
overwrites it, and a suspended TrainJob is replaced to change its size."""
from __future__ import annotations

import copy

import kopf
import pytest
from kubernetes.client.rest import ApiException

from kubetune_api.manifest import parse_manifest
from kubetune_operator import handlers
from kubetune_operator.backends import BACKENDS
from kubetune_operator.settings import Settings
from kubetune_operator.trainer_config import build_config_map

TRAINJOB = BACKENDS["trainjob"]
TRAINJOB_SETTINGS = Settings(backend="trainjob", backends=("trainjob",))


class FakeCustomObjects:
    """The few CustomObjectsApi calls the handlers make, over a dict; errors on request."""

    def __init__(self, objects: dict | None = None, errors: dict | None = None):
        self.objects = objects or {}  # (plural, name) -> object
        self.errors = errors or {}    # (plural, name | None) -> HTTP status
        self.calls: list[tuple] = []

    def _fail(self, plural, name):
        status = self.errors.get((plural, name))
        if status:
            raise ApiException(status=status, reason={403: "Forbidden", 404: "Not Found", 422: "Invalid"}[status])

    def list_namespaced_custom_object(self, group, version, namespace, plural, **_):
        self.calls.append(("list", plural))
        self._fail(plural, None)
        return {"items": [o for (p, _), o in self.objects.items() if p == plural]}

    def get_cluster_custom_object(self, group, version, plural, name):
        self.calls.append(("get", plural, name))
        self._fail(plural, name)
        return self.objects[(plural, name)]

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", plural, name))
        self._fail(plural, name)
        if (plural, name) not in self.objects:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.objects[(plural, name)])

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append(("create", plural, body["metadata"]["name"]))
        self.objects[(plural, body["metadata"]["name"])] = {**body, "metadata": {**body["metadata"], "uid": "new"}}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None):
        self.calls.append(("delete", plural, name, body.propagation_policy))
        self.objects[(plural, name)]["metadata"]["deletionTimestamp"] = "now"

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **_):
        self.calls.append(("patch", plural, name, body))

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, **_):
        """A merge patch of the status; one that names a resourceVersion must name the current one."""
        self.calls.append(("patch-status", plural, name, body))
        self._fail(plural + "/status", name)
        stored = self.objects.get((plural, name))
        if stored is None or isinstance(body, list):
            return
        expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != stored["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        status = {**(stored.get("status") or {}), **body.get("status", {})}
        stored["status"] = {key: value for key, value in status.items() if value is not None}
        stored["metadata"]["resourceVersion"] = str(int(stored["metadata"]["resourceVersion"]) + 1)


class FakeConfigMaps:
    def __init__(self, data: dict | None):
        self.data, self.patches = data, []

    def read_namespaced_config_map(self, name, namespace):
        if self.data is None:
            raise ApiException(status=404, reason="Not Found")
        return type("ConfigMap", (), {"data": self.data, "metadata": type("Meta", (), {"name": name})()})()

    def patch_namespaced_config_map(self, name, namespace, body):
        self.patches.append(body)


@pytest.fixture
def api(monkeypatch):
    """Install a fake custom-objects API (and a trainjob-only operator); returns a setter."""
    monkeypatch.setattr(handlers, "SETTINGS", TRAINJOB_SETTINGS)
    monkeypatch.setattr(handlers, "_present_since", {})
    warnings, events = [], []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warnings.append((reason, message)))
    monkeypatch.setattr(kopf, "event", lambda body, type, reason, message: events.append((type, reason, message)))

    def install(fake: FakeCustomObjects, config_maps: FakeConfigMaps | None = None) -> FakeCustomObjects:
        monkeypatch.setattr(handlers, "custom_api", lambda: fake)
        if config_maps is not None:
            monkeypatch.setattr(handlers, "core_api", lambda: config_maps)
        fake.warnings, fake.events = warnings, events
        return fake
    return install


def job_body(example_manifest, status: dict | None = None, **spec) -> kopf.Body:
    manifest = copy.deepcopy(example_manifest)
    manifest["metadata"] = {"name": "sd15", "namespace": "team-a", "uid": "uid-1", "generation": 2,
                            "resourceVersion": "10"}
    manifest["spec"].update(spec)
    manifest["status"] = status or {}
    return kopf.Body(manifest)


# ---- a backend that is not there yet -----------------------------------------------------------------

@pytest.mark.parametrize("errors,reason", [
    ({("trainjobs", None): 404}, "TrainJobAPIMissing"),
    ({("clustertrainingruntimes", "kubetune-trainer"): 404}, "TrainingRuntimeMissing"),
    ({("clustertrainingruntimes", "kubetune-trainer"): 403}, "BackendNotPermitted"),
], ids=["no-trainjob-crd", "no-runtime", "no-rbac"])
def test_a_missing_piece_is_a_condition_and_one_event_and_the_job_waits(api, example_manifest, errors, reason):
    body = job_body(example_manifest)
    fake = api(FakeCustomObjects({("clustertrainingruntimes", "kubetune-trainer"): {},
                                  ("trainingjobs", "sd15"): dict(body)}, errors))
    job = parse_manifest(dict(body))
    with pytest.raises(kopf.TemporaryError):
        handlers.check_backend(body, job, TRAINJOB)
    status = fake.objects[("trainingjobs", "sd15")]["status"]
    condition = status["conditions"][0]
    assert (condition["type"], condition["status"], condition["reason"]) == ("BackendReady", "False", reason)
    assert (status["phase"], status["backend"]) == ("Pending", "trainjob"), "not lost: waiting, and saying for what"
    assert fake.warnings == [(reason, condition["message"])]
    # The retry finds the same gap: the condition stands, no second event.
    with pytest.raises(kopf.TemporaryError):
        handlers.check_backend(body, job, TRAINJOB)
    assert len(fake.warnings) == 1


def test_once_the_piece_is_there_the_job_goes_on_and_the_look_is_cached(api, example_manifest):
    fake = api(FakeCustomObjects({("clustertrainingruntimes", "kubetune-trainer"): {}}))
    body = job_body(example_manifest)
    job = parse_manifest(dict(body))
    handlers.check_backend(body, job, TRAINJOB)
    looked = len(fake.calls)
    handlers.check_backend(body, job, TRAINJOB)
    assert looked == 2 and len(fake.calls) == looked, "one look per prerequisite per cache period"


def test_a_field_the_backend_cannot_honour_is_refused_for_good(api, example_manifest):
    body = job_body(example_manifest, scheduling={"priorityClassName": "high"})
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(body)}))
    with pytest.raises(kopf.PermanentError, match="spec.scheduling.priorityClassName"):
        handlers.check_backend(body, parse_manifest(dict(body)), TRAINJOB)
    assert fake.objects[("trainingjobs", "sd15")]["status"]["conditions"][0]["reason"] == "UnsupportedByBackend"
    assert [c[1] for c in fake.calls] == ["trainingjobs", "trainingjobs"], \
        "refused without looking for prerequisites: only the status written"


def test_the_webhook_refuses_what_the_backend_cannot_run_and_warns_of_a_backend_not_enabled(api, example_manifest, monkeypatch):
    monkeypatch.setattr(handlers, "missing_secret", lambda job: None)
    body = job_body(example_manifest, runPolicy={"ttlSecondsAfterFinished": 60})
    with pytest.raises(kopf.AdmissionError, match="the trainjob backend cannot run this job: "
                                                  "spec.runPolicy.ttlSecondsAfterFinished"):
        handlers.validate_new_job(body=body, warnings=[])
    # A backend not enabled yet is admitted with a warning: the job waits for it, not lost.
    warnings: list[str] = []
    handlers.validate_new_job(body=job_body(example_manifest, backend="pytorchjob"), warnings=warnings)
    assert warnings == ["BackendReady: spec.backend pytorchjob: this kubetune operator was installed without the "
                        "pytorchjob backend (enabled: trainjob); enable it with helm upgrade kubetune charts/kubetune "
                        "--reuse-values --set pytorchjob.enabled=true, and the job starts"]


# ---- status that ends true ------------------------------------------------------------------------------

def test_a_finished_trainjob_writes_the_final_step_once(api, example_manifest):
    stale = {"step": 26, "totalSteps": 60, "percent": 43.3, "loss": 0.2, "etaSeconds": 12.5}
    owner = job_body(example_manifest, status={"phase": "Running", "progress": stale, "backend": "trainjob"})
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): copy.deepcopy(dict(owner))}))
    child = kopf.Body({"metadata": {"name": "sd15", "ownerReferences": [
        {"kind": "TrainingJob", "name": "sd15", "uid": "uid-1"}]},
        "status": {"conditions": [{"type": "Complete", "status": "True", "reason": "AllJobsCompleted"}]}})
    handlers.follow_children(TRAINJOB)(body=child, namespace="team-a", type="MODIFIED")
    (_, plural, _, body), (_, child_plural, _, child_patch) = [c for c in fake.calls if c[0] == "patch-status"]
    assert plural == "trainingjobs" and body["status"]["phase"] == "Succeeded"
    assert body["status"]["progress"] == {"step": 60, "totalSteps": 60, "percent": 100.0, "loss": 0.2,
                                          "etaSeconds": None}
    assert child_plural == "trainjobs" and child_patch["status"]["trainerStatus"]["progressPercentage"] == 100
    assert [(t, r) for t, r, _ in fake.events] == [("Normal", "Succeeded")]
    # The same child event again (a resync): nothing left to write, no second event.
    handlers.follow_children(TRAINJOB)(body=child, namespace="team-a", type="MODIFIED")
    assert len(fake.events) == 1


def test_a_status_write_raced_by_another_handler_is_computed_again_not_lost(api, example_manifest):
    """The child turned Running while the reconcile wrote BackendReady: both survive."""
    owner = job_body(example_manifest)
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(owner)}))
    stored = fake.objects[("trainingjobs", "sd15")]
    real_get = fake.get_namespaced_custom_object

    def get_then_child_writes(*args):
        read = real_get(*args)
        if not stored.get("status"):  # between this read and the write, the child's state lands
            stored["status"] = {"phase": "Running"}
            stored["metadata"]["resourceVersion"] = "11"
        return read

    fake.get_namespaced_custom_object = get_then_child_writes
    written = handlers.update_status("team-a", "sd15", lambda job: {} if (job.get("status") or {}).get("backend")
                                     else {"backend": "trainjob", **({} if (job.get("status") or {}).get("phase")
                                                                     else {"phase": "Pending"})})
    assert written == {"backend": "trainjob"}, "computed again from the fresh status: Running is not undone"
    assert stored["status"] == {"phase": "Running", "backend": "trainjob"}


def test_a_poll_writes_progress_only_while_the_job_still_runs(api, example_manifest, monkeypatch):
    fake = api(FakeCustomObjects())
    monkeypatch.setattr(handlers, "rank0_pod_ip", lambda namespace, name, backend: "127.1.0.9")
    monkeypatch.setattr(handlers, "read_trainer_gauges", lambda address, port: {"step": 30, "planned_steps": 60})
    body = job_body(example_manifest, status={"phase": "Running", "backend": "trainjob"})
    handlers.poll_progress(name="sd15", namespace="team-a", spec=body["spec"], body=body, logger=handlers.log)
    operations = fake.calls[0][3]
    assert operations[0] == {"op": "test", "path": "/status/phase", "value": "Running"}
    assert {"op": "add", "path": "/status/progress", "value": {"step": 30, "totalSteps": 60, "percent": 50.0}} \
        in operations
    # The job finished between the read and the write: the API server refuses the test; nothing else happens.
    fake.errors[("trainingjobs/status", "sd15")] = 422
    fake.calls.clear()
    handlers.poll_progress(name="sd15", namespace="team-a", spec=body["spec"], body=body, logger=handlers.log)
    assert [c[1] for c in fake.calls] == ["trainingjobs"], "no courtesy copy to the TrainJob either"


# ---- resizing a suspended TrainJob ---------------------------------------------------------------------

def test_a_suspended_trainjob_is_replaced_at_its_new_size(api, example_manifest):
    old = job_body(example_manifest, status={"phase": "Suspended", "backend": "trainjob"}, suspend=True,
                   resources={"nodes": 2, "gpusPerNode": 0}, training={**example_manifest["spec"]["training"],
                                                                        "mixedPrecision": "no"})
    new_spec = {**copy.deepcopy(dict(old["spec"])), "resources": {"nodes": 1, "gpusPerNode": 0}}
    new = kopf.Body({**copy.deepcopy(dict(old)), "spec": new_spec})
    started = parse_manifest({key: value for key, value in dict(old).items() if key != "status"})
    config_maps = FakeConfigMaps(build_config_map(started)["data"])
    running = TRAINJOB.build(started, "uid-1", TRAINJOB_SETTINGS)
    running["metadata"]["uid"] = "child-uid"
    fake = api(FakeCustomObjects({("trainjobs", "sd15"): running}), config_maps)

    # First pass: the old TrainJob goes (foreground: with its JobSet and pods); the handler is retried.
    with pytest.raises(kopf.TemporaryError, match="being replaced at the new size"):
        handlers.spec_changed(body=new, old=dict(old["spec"]), new=new_spec, patch=kopf.Patch())
    assert ("delete", "trainjobs", "sd15", "Foreground") in fake.calls
    assert config_maps.patches == [], "the config keeps the old size until the child has the new one"
    # While it is being deleted, the retry waits; once it is gone, the new one is created at the new size.
    with pytest.raises(kopf.TemporaryError):
        handlers.spec_changed(body=new, old=dict(old["spec"]), new=new_spec, patch=kopf.Patch())
    del fake.objects[("trainjobs", "sd15")]
    handlers.spec_changed(body=new, old=dict(old["spec"]), new=new_spec, patch=kopf.Patch())
    created = fake.objects[("trainjobs", "sd15")]
    assert created["spec"]["trainer"]["numNodes"] == 1 and created["spec"]["suspend"] is True
    assert created["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert "nodes: 1" in config_maps.patches[0]["data"]["trainingjob.yaml"]
    assert ("Normal", "Resized", "resized from 2x1 processes to 1x1 process; the run continues from its latest "
                                 "checkpoint") in fake.events


# ---- the credentials Secret: its existence, never its values ----------------------------------------

class MetadataOnlyClient:
    """Records the requests the operator makes for Secrets; answers as the API server would."""

    def __init__(self, existing: set[tuple[str, str]]):
        self.existing, self.requests = existing, []

    def call_api(self, path, method, path_params=None, header_params=None, **kwargs):
        self.requests.append((path.format(**path_params), method, header_params))
        if (path_params["namespace"], path_params["name"]) not in self.existing:
            raise ApiException(status=404, reason="Not Found")
        return object()


def test_the_credentials_secret_is_checked_by_its_metadata_only(example_manifest, monkeypatch):
    api_client = MetadataOnlyClient({("team-a", "s3-credentials")})
    monkeypatch.setattr(handlers, "core_api", lambda: type("Core", (), {"api_client": api_client})())
    job = parse_manifest(dict(job_body(example_manifest, s3={"credentialsSecret": "s3-credentials"})))
    assert handlers.missing_secret(job) is None
    path, method, headers = api_client.requests[0]
    assert (path, method) == ("/api/v1/namespaces/team-a/secrets/s3-credentials", "GET")
    assert headers["Accept"].startswith("application/json;as=PartialObjectMetadata"), "no data is sent back"

    gone = parse_manifest(dict(job_body(example_manifest, s3={"credentialsSecret": "not-there"})))
    assert "Secret 'not-there' does not exist in namespace 'team-a'" in handlers.missing_secret(gone)
