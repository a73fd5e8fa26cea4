"""The reconcile's glue around the pure decide, against in-memory stand-ins for the API server: one status
write guarded by the resourceVersion it was decided from (a race is decided again, never overwritten),
the actions done in order, events said once the status holds the news; and the admission webhook."""
from __future__ import annotations

import copy

import kopf
import pytest
from kubernetes.client import ApiClient
from kubernetes.client.rest import ApiException

from kubetune_operator import handlers, kube, reconcile
from kubetune_operator.backends import BACKENDS
from kubetune_operator.settings import Settings

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
        if (plural, body["metadata"]["name"]) in self.objects:
            raise ApiException(status=409, reason="Conflict")
        created = {**body, "metadata": {**body["metadata"], "uid": "new", "resourceVersion": f"rv-{len(self.calls)}"}}
        self.objects[(plural, body["metadata"]["name"])] = created
        return copy.deepcopy(created)

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


class FakeCore:
    """ConfigMaps and pods, as the CoreV1Api calls of the reconcile use them."""

    def __init__(self, data: dict | None = None):
        self.data, self.created, self.patches, self.owners = data, [], [], ["uid-1"]
        self.version = 1
        self.api_client = ApiClient()  # its sanitize_for_serialization only: pods as the API server writes them

    def read_namespaced_config_map(self, name, namespace):
        if self.data is None:
            raise ApiException(status=404, reason="Not Found")
        owners = [type("Ref", (), {"uid": uid})() for uid in self.owners]
        return type("ConfigMap", (), {"data": self.data, "metadata": type("Meta", (), {
            "name": name, "owner_references": owners, "resource_version": str(self.version)})()})()

    def create_namespaced_config_map(self, namespace, body):
        if self.data is not None:
            raise ApiException(status=409, reason="Conflict")
        self.created.append(body)
        self.data, self.owners = body["data"], [ref["uid"] for ref in body["metadata"]["ownerReferences"]]

    def patch_namespaced_config_map(self, name, namespace, body):
        """A merge patch of the data; one that names a resourceVersion must name the current one."""
        expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != str(self.version):
            raise ApiException(status=409, reason="Conflict")
        self.patches.append(body)
        self.data, self.version = {**self.data, **body["data"]}, self.version + 1

    def list_namespaced_pod(self, namespace, label_selector):
        return type("Pods", (), {"items": []})()


@pytest.fixture
def api(monkeypatch):
    """Install fake APIs (and a trainjob-only operator); returns a setter."""
    monkeypatch.setattr(kube, "settings", lambda: TRAINJOB_SETTINGS)
    monkeypatch.setattr(kube, "_present_since", {})
    events = []
    monkeypatch.setattr(kube, "post_event", lambda body, type_, reason, message: events.append((type_, reason, message)))
    monkeypatch.setattr(kopf, "adopt", lambda obj, owner: obj["metadata"].setdefault("ownerReferences", [
        {"kind": "TrainingJob", "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}]))

    def install(fake: FakeCustomObjects, core: FakeCore | None = None) -> FakeCustomObjects:
        core = core or FakeCore()
        monkeypatch.setattr(kube, "custom_api", lambda: fake)
        monkeypatch.setattr(kube, "core_api", lambda: core)
        fake.events = events
        return fake
    return install


def job_body(example_manifest, status: dict | None = None, **spec) -> kopf.Body:
    manifest = copy.deepcopy(example_manifest)
    manifest["metadata"] = {"name": "sd15", "namespace": "team-a", "uid": "uid-1", "generation": 2,
                            "resourceVersion": "10"}
    manifest["spec"].update(spec)
    manifest["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 0}
    manifest["spec"]["training"] = {**manifest["spec"]["training"], "mixedPrecision": "no"}
    manifest["status"] = status or {}
    return kopf.Body(manifest)


def test_a_new_job_gets_its_children_one_status_write_and_one_event(api, example_manifest):
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}))
    reconcile.reconcile("team-a", "sd15")
    assert ("create", "trainjobs", "sd15") in fake.calls
    child = fake.objects[("trainjobs", "sd15")]
    assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    stored = fake.objects[("trainingjobs", "sd15")]["status"]
    assert (stored["phase"], stored["backend"]) == ("Pending", "trainjob")
    assert [c[0] for c in fake.calls].count("patch-status") == 1
    assert [(t, r) for t, r, _ in fake.events] == [("Normal", "Created")]
    # Again (a repeated trigger): the child exists, nothing is created twice, nothing said twice.
    fake.calls.clear()
    reconcile.reconcile("team-a", "sd15")
    assert not [c for c in fake.calls if c[0] == "create"] and len(fake.events) == 1


def test_a_new_job_as_its_event_delivered_it_gets_its_children_without_a_read(api, example_manifest):
    """Status empty: no reconcile acted on it, so nothing of its own is looked for before the creates."""
    core = FakeCore()
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}), core)
    reconcile.reconcile("team-a", "sd15", job_seen=copy.deepcopy(fake.objects[("trainingjobs", "sd15")]))
    assert [c[:2] for c in fake.calls if c[0] in ("get", "create")] == [("get", "clustertrainingruntimes"),
                                                                         ("create", "trainjobs")]
    assert fake.objects[("trainingjobs", "sd15")]["status"]["phase"] == "Pending" and core.created
    assert [(t, r) for t, r, _ in fake.events] == [("Normal", "Created")]


def test_children_an_interrupted_reconcile_made_are_taken_as_this_jobs_own(api, example_manifest):
    """Created, then the operator died before the status write: the job still looks new."""
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}))
    reconcile.reconcile("team-a", "sd15")
    fake.objects[("trainingjobs", "sd15")].pop("status")
    fake.events.clear()
    reconcile.reconcile("team-a", "sd15", job_seen=copy.deepcopy(fake.objects[("trainingjobs", "sd15")]))
    assert [c[0] for c in fake.calls].count("create") == 2, "tried again, found to be its own (409)"
    assert fake.objects[("trainingjobs", "sd15")]["status"]["phase"] == "Pending"
    assert fake.events == [], "the child was announced when it was created"


def test_a_missing_backend_piece_is_waited_for_with_a_retry_and_looked_for_once_per_period(api, example_manifest):
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest))},
                                 {("clustertrainingruntimes", "kubetune-trainer"): 404}))
    with pytest.raises(kopf.TemporaryError):
        reconcile.reconcile("team-a", "sd15")
    assert fake.objects[("trainingjobs", "sd15")]["status"]["conditions"][0]["reason"] == "TrainingRuntimeMissing"
    assert [(t, r) for t, r, _ in fake.events] == [("Warning", "TrainingRuntimeMissing")]
    fake.errors.clear()
    fake.objects[("clustertrainingruntimes", "kubetune-trainer")] = {}
    reconcile.reconcile("team-a", "sd15")
    looks = [c for c in fake.calls if c[0] in ("get", "list") and c[1] in ("trainjobs", "clustertrainingruntimes")]
    fake.calls.clear()
    reconcile.reconcile("team-a", "sd15")
    assert not [c for c in fake.calls if c[1] == "clustertrainingruntimes"], "the child exists: no look at all"
    assert looks


def test_a_status_write_raced_by_another_trigger_is_decided_again_not_lost(api, example_manifest):
    """Another reconcile writes between this one's read and write: the write is refused (409) and this
    one decides again from the fresh object, so what the other wrote is kept."""
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}))
    stored = fake.objects[("trainingjobs", "sd15")]
    real_get = fake.get_namespaced_custom_object

    def get_then_another_writer(*args):
        read = real_get(*args)
        if args[3] == "trainingjobs" and not stored.get("status"):
            stored["status"] = {"conditions": [{"type": "Other", "status": "True"}]}
            stored["metadata"]["resourceVersion"] = "11"
        return read

    fake.get_namespaced_custom_object = get_then_another_writer
    reconcile.reconcile("team-a", "sd15")
    assert stored["status"]["conditions"][0] == {"type": "Other", "status": "True"}, "decided again, not overwritten"
    assert stored["status"]["phase"] == "Pending"
    assert [c[0] for c in fake.calls].count("patch-status") == 2, "the first write refused, the second one made"


def test_the_children_of_an_older_job_of_the_same_name_are_not_taken_for_this_ones(api, example_manifest):
    old_child = {"metadata": {"name": "sd15", "uid": "old-child", "ownerReferences": [{"uid": "uid-0"}]},
                 "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    core = FakeCore({"trainingjob.yaml": "left by uid-0"})
    core.owners = ["uid-0"]
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {},
                                  ("trainjobs", "sd15"): old_child}), core)
    with pytest.raises(kopf.TemporaryError, match="belongs to something else"):
        reconcile.reconcile("team-a", "sd15")
    assert (fake.objects[("trainingjobs", "sd15")].get("status") or {}).get("phase") != "Succeeded"


def test_a_child_event_reconciles_its_owner_only_while_that_very_job_exists(monkeypatch):
    reconciled = []
    monkeypatch.setattr(handlers, "reconcile", lambda namespace, name, child_seen: reconciled.append((namespace, name)))
    child = kopf.Body({"metadata": {"name": "sd15", "resourceVersion": "7", "ownerReferences": [
        {"kind": "TrainingJob", "name": "sd15", "uid": "uid-1"}]}})
    handlers.child_changed(body=child, namespace="team-a", type="MODIFIED", training_jobs={})
    handlers.child_changed(body=child, namespace="team-a", type="MODIFIED",
                           training_jobs={("team-a", "sd15"): ["uid-2"]})  # a new job of that name
    assert reconciled == []
    handlers.child_changed(body=child, namespace="team-a", type="MODIFIED",
                           training_jobs={("team-a", "sd15"): ["uid-1"]})
    assert reconciled == [("team-a", "sd15")]


def test_the_event_of_the_child_a_reconcile_created_costs_no_second_reconcile(api, example_manifest, monkeypatch):
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}))
    reconcile.reconcile("team-a", "sd15")
    created = fake.objects[("trainjobs", "sd15")]
    seen = []
    monkeypatch.setattr(handlers, "reconcile", lambda namespace, name, child_seen: seen.append(child_seen))
    owners = {("team-a", "sd15"): [created["metadata"]["ownerReferences"][0]["uid"]]}
    handlers.child_changed(body=kopf.Body(copy.deepcopy(created)), namespace="team-a", type="ADDED",
                           training_jobs=owners)
    assert seen == [], "the very version the reconcile created and decided from"
    changed = copy.deepcopy(created)
    changed["metadata"]["resourceVersion"] = "later"
    handlers.child_changed(body=kopf.Body(changed), namespace="team-a", type="MODIFIED", training_jobs=owners)
    handlers.child_changed(body=kopf.Body(copy.deepcopy(created)), namespace="team-a", type="MODIFIED",
                           training_jobs=owners)  # each created version is answered once only
    assert [child["metadata"]["resourceVersion"] for child in seen] == ["later", created["metadata"]["resourceVersion"]]


def test_the_first_status_write_already_shows_the_child_as_created(api, example_manifest):
    """So the reconcile its creation's event would have run has nothing left to write."""
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest, suspend=True)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}))
    reconcile.reconcile("team-a", "sd15")
    conditions = {c["type"]: c["status"] for c in fake.objects[("trainingjobs", "sd15")]["status"]["conditions"]}
    assert conditions["Suspended"] == "True" and conditions["Running"] == "False"
    fake.calls.clear()
    reconcile.reconcile("team-a", "sd15")
    assert [c for c in fake.calls if c[0] == "patch-status"] == []


def test_a_reconcile_takes_the_child_an_event_delivered_instead_of_reading_it(api, example_manifest):
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}))
    reconcile.reconcile("team-a", "sd15")
    delivered = copy.deepcopy(fake.objects[("trainjobs", "sd15")])
    fake.calls.clear()
    reconcile.reconcile("team-a", "sd15", child_seen=delivered)
    assert ("get", "trainjobs", "sd15") not in fake.calls
    assert ("get", "trainingjobs", "sd15") in fake.calls


def test_a_deleted_or_deleting_job_is_left_to_the_garbage_collector(api, example_manifest):
    fake = api(FakeCustomObjects())
    reconcile.reconcile("team-a", "sd15")
    assert [c[0] for c in fake.calls] == ["get"]


# ---- generation on the cluster: the same reconcile, finished job or not ------------------------------------

class FakeBatch:
    """The BatchV1Api calls of `generate --on-cluster` over a dict of Jobs; every create refused on request."""

    def __init__(self, refuse: int | None = None):
        self.jobs: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.refuse = refuse
        self.api_client = type("ApiClient", (), {"sanitize_for_serialization": staticmethod(lambda job: job.body)})()

    def read_namespaced_job(self, name, namespace):
        self.calls.append(("read", name))
        if name not in self.jobs:
            raise ApiException(status=404, reason="Not Found")
        body = copy.deepcopy(self.jobs[name])
        owners = [type("Ref", (), {"uid": ref["uid"]})() for ref in body["metadata"].get("ownerReferences", [])]
        return type("Job", (), {"body": body, "metadata": type("Meta", (), {"owner_references": owners})()})()

    def create_namespaced_job(self, namespace, body):
        self.calls.append(("create", body["metadata"]["name"]))
        if self.refuse:
            raise ApiException(status=self.refuse, reason="Forbidden")
        if body["metadata"]["name"] in self.jobs:
            raise ApiException(status=409, reason="Conflict")
        self.jobs[body["metadata"]["name"]] = copy.deepcopy(body)


def asking_job(example_manifest) -> dict:
    """A job that succeeded, annotated by `kubetune generate --on-cluster`."""
    from kubetune_api.contract import GENERATE_ANNOTATION
    from kubetune_api.generation_request import GenerationRequest

    job = dict(job_body(example_manifest, status={"phase": "Succeeded", "backend": "trainjob"}))
    request = GenerationRequest(id="abc123", run="/checkpoints/team-a/sd15/v0", step="final")
    job["metadata"] = {**job["metadata"], "annotations": {GENERATE_ANNOTATION: request.to_annotation()}}
    return job


@pytest.fixture
def batch(api, monkeypatch):
    monkeypatch.setattr(reconcile, "_generation_refusals", {})

    def install(fake: FakeBatch) -> FakeBatch:
        monkeypatch.setattr(kube, "batch_api", lambda: fake)
        return fake
    return install


def visited_by_the_timer(job: dict) -> bool:
    return handlers.still_active(spec=job["spec"], body=kopf.Body(job))


def test_a_finished_job_draws_once_and_answers_in_its_status_until_the_timer_stops(api, batch, example_manifest):
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): asking_job(example_manifest)}))
    jobs = batch(FakeBatch())
    stored = fake.objects[("trainingjobs", "sd15")]
    assert visited_by_the_timer(stored), "a pending request keeps the timer on a finished job"
    reconcile.reconcile("team-a", "sd15")
    assert [c for c in jobs.calls if c[0] == "create"] == [("create", "sd15-generate-abc123")]
    assert jobs.jobs["sd15-generate-abc123"]["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert [(e["id"], e["phase"]) for e in stored["status"]["generations"]] == [("abc123", "Running")]
    assert stored["status"]["phase"] == "Succeeded"
    reconcile.reconcile("team-a", "sd15")  # the timer again, the Job still drawing
    assert [c[0] for c in jobs.calls].count("create") == 1
    assert [(t, r) for t, r, _ in fake.events] == [("Normal", "Generating")]
    jobs.jobs["sd15-generate-abc123"]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    reconcile.reconcile("team-a", "sd15")
    assert [(e["id"], e["phase"]) for e in stored["status"]["generations"]] == [("abc123", "Succeeded")]
    assert not visited_by_the_timer(stored), "answered: the finished job is left alone again"
    jobs.calls.clear()
    reconcile.reconcile("team-a", "sd15")
    assert jobs.calls == [], "an answered request costs no API call"


def test_a_generation_job_the_api_server_refuses_is_answered_failed_in_the_same_reconcile(api, batch,
                                                                                       example_manifest):
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): asking_job(example_manifest)}))
    jobs = batch(FakeBatch(refuse=403))
    reconcile.reconcile("team-a", "sd15")
    (entry,) = fake.objects[("trainingjobs", "sd15")]["status"]["generations"]
    assert (entry["id"], entry["phase"], entry["message"]) == (
        "abc123", "Failed", "annotation kubetune.dev/generate: 403 Forbidden")
    assert [(t, r) for t, r, _ in fake.events] == [("Warning", "GenerationRefused")]
    reconcile.reconcile("team-a", "sd15")
    assert [c[0] for c in jobs.calls].count("create") == 1 and len(fake.events) == 1


# ---- admission -------------------------------------------------------------------------------------------

def test_the_webhook_refuses_what_the_backend_cannot_run_and_warns_of_a_backend_not_enabled(api, example_manifest):
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


def test_the_webhook_refuses_a_queue_label_that_disagrees_with_the_spec_naming_both(api, example_manifest):
    body = job_body(example_manifest, scheduling={"queueName": "jobs"})
    body = kopf.Body({**dict(body), "metadata": {**dict(body)["metadata"],
                                                 "labels": {"kueue.x-k8s.io/queue-name": "other"}}})
    with pytest.raises(kopf.AdmissionError, match=r"metadata.labels\[kueue.x-k8s.io/queue-name\] is 'other' but "
                                                  "spec.scheduling.queueName is 'jobs'"):
        handlers.validate_new_job(body=body, warnings=[])


def test_the_webhook_reads_no_secret(api, example_manifest):
    """A credentials Secret that does not exist is the pods' to report: admission does not look."""
    handlers.validate_new_job(body=job_body(example_manifest, s3={"credentialsSecret": "not-there"}), warnings=[])


def test_the_created_event_is_said_even_when_the_status_write_after_it_is_raced(api, example_manifest):
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(job_body(example_manifest)),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}))
    stored = fake.objects[("trainingjobs", "sd15")]
    real_create = fake.create_namespaced_custom_object

    def create_then_kopf_patches(group, version, namespace, plural, body):
        created = real_create(group, version, namespace, plural, body)
        stored["metadata"]["resourceVersion"] = "11"  # e.g. kopf's finalizer, between read and status write
        return created

    fake.create_namespaced_custom_object = create_then_kopf_patches
    reconcile.reconcile("team-a", "sd15")
    assert [(t, r) for t, r, _ in fake.events] == [("Normal", "Created")]
    assert stored["status"]["phase"] == "Pending"



def test_a_run_that_ended_unseen_is_finished_with_the_report_its_pod_left(api, example_manifest):
    """Pending at the last look, its child complete now: the validation comes from rank 0's
    termination message (kept in the pod's status), read once, as the job is marked finished."""
    import datetime

    from kubernetes.client import (V1ContainerState, V1ContainerStateTerminated, V1ContainerStatus, V1ObjectMeta,
                                   V1Pod, V1PodStatus)

    from kubetune_api.contract import final_report
    from kubetune_api.spec import TrainingJob
    from kubetune_operator.trainer_config import build_config_map

    body = dict(job_body(example_manifest, status={"phase": "Pending", "backend": "trainjob"},
                         validation={"everySteps": 1, "prompts": ["a corgi"]}))
    typed = TrainingJob.model_validate({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    child = TRAINJOB.build(typed, "uid-1", TRAINJOB_SETTINGS)
    child["metadata"].update(uid="child-uid", resourceVersion="1", ownerReferences=[{"kind": "TrainingJob", "name": "sd15", "uid": "uid-1"}])
    child["status"] = {"conditions": [{"type": "Complete", "status": "True", "reason": "AllJobsCompleted"}]}

    def pod(created_minute: int, message: str | None) -> V1Pod:
        ended = V1ContainerStateTerminated(exit_code=0, message=message)
        return V1Pod(metadata=V1ObjectMeta(name=f"sd15-node-0-{created_minute}", creation_timestamp=datetime.datetime(
            2026, 11, 27, 12, created_minute, tzinfo=datetime.timezone.utc)),
            status=V1PodStatus(phase="Succeeded", container_statuses=[V1ContainerStatus(
                name="node", image="trainer", image_id="", ready=False, restart_count=0,
                state=V1ContainerState(terminated=ended))]))

    core = FakeCore(build_config_map(typed)["data"])
    older = final_report({"step": 3, "planned_steps": 6, "validation_step": 3, "validation_loss": 0.9})
    newest = final_report({"step": 6, "planned_steps": 6, "run_version": 0, "validation_step": 6,
                           "validation_loss": 0.25})
    pods = [pod(1, older), pod(3, "not a report"), pod(2, newest)]
    core.list_namespaced_pod = lambda namespace, label_selector: type("Pods", (), {"items": pods})()
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): body, ("trainjobs", "sd15"): child}), core)
    reconcile.reconcile("team-a", "sd15")
    stored = fake.objects[("trainingjobs", "sd15")]["status"]
    assert stored["phase"] == "Succeeded"
    assert stored["validation"] == {"step": 6, "metrics": {"loss": 0.25}}, "the newest pod's report, not an older one"
    assert stored["progress"]["step"] == 6 and stored["outputUri"].endswith("/v0")


def test_an_event_is_posted_with_the_operators_client_from_any_thread(monkeypatch):
    """The one timer's visits run on kopf's threads outside kopf's handler context, where kopf.event
    raised and the event was lost: the operator's own client posts it wherever it is decided."""
    import threading

    posted = []
    core = type("Core", (), {"create_namespaced_event": lambda self, namespace, body: posted.append((namespace, body))})()
    monkeypatch.setattr(kube, "core_api", lambda: core)
    job = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "early", "namespace": "team-a", "uid": "uid-1"}}
    visit = threading.Thread(target=kube.post_event, args=(job, "Warning", "Inadmissible", "x" * 5000))
    visit.start()
    visit.join()
    [(namespace, event)] = posted
    assert namespace == "team-a" and (event["type"], event["reason"]) == ("Warning", "Inadmissible")
    assert event["involvedObject"] == {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "name": "early",
                                       "namespace": "team-a", "uid": "uid-1"}
    assert len(event["message"]) == kube.MAX_EVENT_MESSAGE


def test_two_reconciles_that_saw_the_old_size_resize_once_and_say_it_once(api, example_manifest):
    """Two triggers of a resized job both decided from the ConfigMap at its old size: the first one's
    ConfigMap write moves it on, so the second one's (guarded by the version it read) is refused and
    that reconcile decides again instead of saying Resized a second time (seen in the e2e resize)."""
    from kubetune_api.spec import TrainingJob
    from kubetune_operator.decision import Observed, decide
    from kubetune_operator.trainer_config import build_config_map, job_from_config_map

    old = job_body(example_manifest, status={"phase": "Suspended", "backend": "trainjob"}, suspend=True)
    old["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 0}
    new = job_body(example_manifest, status={"phase": "Suspended", "backend": "trainjob"}, suspend=True)
    core = FakeCore(build_config_map(TrainingJob.model_validate(
        {k: old[k] for k in ("apiVersion", "kind", "metadata", "spec")}))["data"])
    fake = api(FakeCustomObjects({("trainingjobs", "sd15"): dict(new),
                                  ("clustertrainingruntimes", "kubetune-trainer"): {}}), core)
    data, version = kube.read_config_map("team-a", "sd15", "uid-1")
    seen_by_both = Observed(name="sd15", namespace="team-a", uid="uid-1", generation=2, settings=TRAINJOB_SETTINGS,
                            now=kube.now(), config_map=data, config_map_version=version)
    first, second = (decide(dict(new["spec"]), dict(new["status"]), seen_by_both) for _ in range(2))
    assert ("Normal", "Resized") in [(e.type, e.reason) for e in first.action_events + second.action_events]
    assert reconcile.act(dict(new), first) is True
    assert reconcile.act(dict(new), second) is False, "the stale ConfigMap write is refused: decided again"
    assert [reason for _, reason, _ in fake.events].count("Resized") == 1
    assert len(core.patches) == 1 and job_from_config_map(core.data).spec.resources.nodes == 1
