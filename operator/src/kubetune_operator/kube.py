"""All of the operator's Kubernetes I/O: clients, reads, idempotent creates, patches, events.

The reconcile (reconcile.py) observes through the readers here and acts through the writers; the
decisions in between (decision.py) are pure. TrainingSweeps (sweeps.py) use the same clients and
create_owned. Nothing here decides anything: each function is one request or one retry rule.
"""
from __future__ import annotations

import functools
import logging
import time
import urllib.parse
import urllib.request

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families

from kubetune_api.contract import API_GROUP, API_VERSION, KIND, OPERATOR_READ_QUERY, PLURAL, TRAINER_METRIC_PREFIX
from kubetune_operator import backend_check, metrics, naming, queueing, volume_policy
from kubetune_operator.backends import Backend, operator_settings
from kubetune_operator.settings import Settings
from kubetune_operator.timestamps import rfc3339

log = logging.getLogger("kubetune.operator")


@functools.cache
def settings() -> Settings:
    """The operator's settings, read from the environment once, on first use (not at import)."""
    return operator_settings()


def now() -> str:
    return rfc3339(time.time())


def load_kubernetes_config() -> None:
    """In a pod: the service account; elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def resource_of(url: str) -> str:
    """The resource a request URL names, e.g. `.../apis/G/V/namespaces/NS/trainjobs/NAME/status` ->
    `trainjobs/status`: a metric label with a small fixed set of values (no names)."""
    parts = urllib.parse.urlsplit(url).path.strip("/").split("/")
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    return "/".join(rest[:1] + rest[2:3]) or "/"


class _TimedApiClient(client.ApiClient):
    """The Kubernetes client, each request timed into metrics.API_REQUEST_SECONDS."""

    def request(self, method, url, *args, **kwargs):
        started = time.monotonic()
        try:
            return super().request(method, url, *args, **kwargs)
        finally:
            metrics.API_REQUEST_SECONDS.labels(method.lower(), resource_of(url)).observe(time.monotonic() - started)


@functools.cache
def core_api() -> client.CoreV1Api:
    """One client per process: connections are pooled and reused across handler calls."""
    return client.CoreV1Api(_TimedApiClient())


@functools.cache
def custom_api() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(core_api().api_client)


@functools.cache
def networking_api() -> client.NetworkingV1Api:
    return client.NetworkingV1Api(core_api().api_client)


@functools.cache
def batch_api() -> client.BatchV1Api:
    return client.BatchV1Api(core_api().api_client)


class Refused(Exception):
    """The API server refuses a request for good: 403 (no right to it) or 422 (an object it will not take)."""


def _refusal_raised(request):
    """REQUEST(), with a refusal for good raised as Refused("<status> <reason>")."""
    try:
        return request()
    except ApiException as err:
        if err.status in (403, 422):
            raise Refused(f"{err.status} {err.reason}") from None
        raise


def _missing_is_none(read):
    """READ(), or None where the API server answers 404."""
    try:
        return read()
    except ApiException as err:
        if err.status == 404:
            return None
        raise


# ---- reads ------------------------------------------------------------------------------------------

def read_training_job(namespace: str, name: str) -> dict | None:
    return _missing_is_none(lambda: custom_api().get_namespaced_custom_object(API_GROUP, API_VERSION, namespace,
                                                                              PLURAL, name))


def read_config_map(namespace: str, job_name: str, owner_uid: str) -> tuple[dict, str] | None:
    """The trainer ConfigMap's data and resourceVersion, or None when OWNER_UID has none (the job never
    started; one left by an older TrainingJob of the same name is not this job's: creating this job's
    is then refused)."""
    found = _missing_is_none(lambda: core_api().read_namespaced_config_map(naming.config_map_name(job_name),
                                                                           namespace))
    if found is None or owner_uid not in [ref.uid for ref in found.metadata.owner_references or []]:
        return None
    return dict(found.data or {}), found.metadata.resource_version


def read_child(backend: Backend, namespace: str, job_name: str, owner_uid: str) -> dict | None:
    """The child job OWNER_UID owns, or None: not created yet, deleted, its API not served (then
    missing_prerequisite says which), or one of an older TrainingJob of the same name (creating this
    job's is then refused until that one is gone)."""
    child = _missing_is_none(lambda: custom_api().get_namespaced_custom_object(
        backend.group, backend.version, namespace, backend.plural, naming.child_name(job_name)))
    if child is None or owner_uid not in [ref.get("uid") for ref in child["metadata"].get("ownerReferences", [])]:
        return None
    return child


def pod_security_level(namespace: str) -> str | None:
    """The Pod Security Standard NAMESPACE enforces (its volume_policy.ENFORCE_LABEL), None without one.
    A list narrowed to the one name: the chart grants list on namespaces (kopf follows them), not get."""
    found = core_api().list_namespace(field_selector=f"metadata.name={namespace}").items
    return (found[0].metadata.labels or {}).get(volume_policy.ENFORCE_LABEL) if found else None


def read_workload(namespace: str, child_uid: str, enabled: bool) -> dict | None:
    """Kueue's Workload of the child job (Kueue labels it with the job's UID), or None: none yet, Kueue
    not installed, or reading Workloads not granted (the chart's kueue.enabled is false)."""
    if not enabled:
        return None
    group, version, plural = queueing.WORKLOADS
    try:
        found = custom_api().list_namespaced_custom_object(
            group, version, namespace, plural, label_selector=f"{queueing.WORKLOAD_JOB_UID_LABEL}={child_uid}")
    except ApiException as err:
        if err.status in (403, 404):
            log.debug("Kueue Workloads not readable in %s: %s", namespace, err.reason)
            return None
        raise
    return found["items"][0] if found["items"] else None


def read_generation_job(namespace: str, name: str, owner_uid: str) -> dict | None:
    """A `generate --on-cluster` batch Job OWNER_UID owns, as the API returns it (camelCase), or None;
    raises Refused where the operator may not read Jobs."""
    batch = batch_api()
    found = _refusal_raised(lambda: _missing_is_none(lambda: batch.read_namespaced_job(name, namespace)))
    if found is None or owner_uid not in [ref.uid for ref in found.metadata.owner_references or []]:
        return None
    return batch.api_client.sanitize_for_serialization(found)


def trainer_pods(namespace: str, job_name: str, backend: Backend) -> list:
    """The rank-0 pods of a job's child (V1Pod objects)."""
    return core_api().list_namespaced_pod(namespace, label_selector=backend.rank0_pod_selector(job_name)).items


def read_trainer_gauges(address: str, port: int) -> dict[str, float]:
    # Marked as the operator's, so that a finishing trainer waits for this read, not Prometheus'.
    with urllib.request.urlopen(f"http://{address}:{port}/metrics?{OPERATOR_READ_QUERY}", timeout=3) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(f"{TRAINER_METRIC_PREFIX}_"):
            for sample in family.samples:
                samples[sample.name.removeprefix(f"{TRAINER_METRIC_PREFIX}_")] = sample.value
    return samples


# Prerequisites seen present recently: one look per this many seconds, not one per job.
PREREQUISITE_CACHE_SECONDS = 30.0
_present_since: dict[tuple[str, str, str | None], float] = {}


def missing_prerequisite(backend: Backend, namespace: str, settings_: Settings) -> backend_check.Problem | None:
    """Ask the API server for what the backend needs; the first thing missing, or None. An API is
    looked for in the job's NAMESPACE: with operator.watchNamespaces the operator may list the child
    jobs there only."""
    custom = custom_api()
    for need in backend.prerequisites(settings_):
        key = (need.group, need.plural, need.name)
        if time.monotonic() - _present_since.get(key, float("-inf")) < PREREQUISITE_CACHE_SECONDS:
            continue
        try:
            if need.name:
                custom.get_cluster_custom_object(need.group, need.version, need.plural, need.name)
            else:  # the API is served when listing works (an empty list included)
                custom.list_namespaced_custom_object(need.group, need.version, namespace, need.plural, limit=1)
        except ApiException as err:
            if err.status == 404:
                _present_since.pop(key, None)
                return backend_check.missing(need)
            if err.status == 403:
                return backend_check.forbidden(need, backend)
            raise
        _present_since[key] = time.monotonic()
    return None


def forget_prerequisites() -> None:
    """Look again next time (a child vanished: its API may have gone with it)."""
    _present_since.clear()


# ---- writes -----------------------------------------------------------------------------------------

def create_owned(obj: dict, owner_uid: str, create, read_owner_uids) -> bool:
    """Create, or accept an existing object only if this owner owns it (restarts, re-runs).

    Returns whether it was created now.
    """
    try:
        create(obj)
        return True
    except ApiException as err:
        if err.status != 409:
            raise
    if owner_uid not in read_owner_uids():
        raise kopf.TemporaryError(
            f"{obj['kind']} {obj['metadata']['name']} exists and belongs to something else "
            "(an older TrainingJob of the same name still being deleted?)", delay=10)
    return False


def create_config_map(obj: dict, owner_uid: str) -> bool:
    namespace, core = obj["metadata"]["namespace"], core_api()
    return create_owned(obj, owner_uid, lambda o: core.create_namespaced_config_map(namespace, o),
                        lambda: [ref.uid for ref in core.read_namespaced_config_map(
                            obj["metadata"]["name"], namespace).metadata.owner_references or []])


def create_network_policy(obj: dict, owner_uid: str) -> bool:
    namespace, networking = obj["metadata"]["namespace"], networking_api()
    return create_owned(obj, owner_uid, lambda o: networking.create_namespaced_network_policy(namespace, o),
                        lambda: [ref.uid for ref in networking.read_namespaced_network_policy(
                            obj["metadata"]["name"], namespace).metadata.owner_references or []])


def create_child(backend: Backend, obj: dict, owner_uid: str) -> str | None:
    """The new child's resourceVersion when it was created now; None when this owner's child existed."""
    namespace, custom, created = obj["metadata"]["namespace"], custom_api(), {}
    made_now = create_owned(obj, owner_uid,
                            lambda o: created.update(custom.create_namespaced_custom_object(
                                backend.group, backend.version, namespace, backend.plural, o)),
                            lambda: [ref["uid"] for ref in custom.get_namespaced_custom_object(
                                backend.group, backend.version, namespace, backend.plural,
                                obj["metadata"]["name"])["metadata"].get("ownerReferences", [])])
    return created["metadata"]["resourceVersion"] if made_now else None


def create_generation_job(obj: dict, owner_uid: str) -> bool:
    """Raises Refused where the API server will not take it (no right to create Jobs, a Job it refuses)."""
    namespace, batch = obj["metadata"]["namespace"], batch_api()
    return _refusal_raised(lambda: create_owned(
        obj, owner_uid, lambda o: batch.create_namespaced_job(namespace, o),
        lambda: [ref.uid for ref in batch.read_namespaced_job(obj["metadata"]["name"],
                                                              namespace).metadata.owner_references or []]))


def patch_child(backend: Backend, job_name: str, namespace: str, body: dict | list) -> None:
    """A merge patch (dict) or a JSON patch (list) of the child job; a failed JSON patch `test`
    (the child changed meanwhile, e.g. was resumed) is retried, so that the decision is made again."""
    try:
        custom_api().patch_namespaced_custom_object(
            backend.group, backend.version, namespace, backend.plural, naming.child_name(job_name), body,
            _content_type="application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json")
    except ApiException as err:
        if err.status == 422 and isinstance(body, list):
            raise kopf.TemporaryError(f"the child job changed while it was patched: {err.reason}", delay=2) from None
        raise


def delete_child(backend: Backend, namespace: str, name: str, uid: str) -> None:
    """Foreground deletion of exactly this child (its UID): its JobSet and pods go first."""
    try:
        custom_api().delete_namespaced_custom_object(
            backend.group, backend.version, namespace, backend.plural, name,
            body=client.V1DeleteOptions(propagation_policy="Foreground",
                                        preconditions=client.V1Preconditions(uid=uid)))
    except ApiException as err:
        if err.status not in (404, 409):  # gone already, or another object of that name now
            raise


def patch_config_map(namespace: str, job_name: str, resource_version: str | None, data: dict) -> bool:
    """The trainer ConfigMap's data, only if it is still at RESOURCE_VERSION (the one the change was
    decided from): False when another reconcile changed it meanwhile (decide again; that one said
    what it did). None: unguarded."""
    guard = {} if resource_version is None else {"metadata": {"resourceVersion": resource_version}}
    try:
        core_api().patch_namespaced_config_map(naming.config_map_name(job_name), namespace, {**guard, "data": data})
        return True
    except ApiException as err:
        if err.status == 409:
            return False
        raise


def patch_workload(namespace: str, name: str, resource_version: str, body: dict) -> bool:
    """A merge patch of Kueue's Workload NAME (its annotations), only if it is still at RESOURCE_VERSION:
    False when it changed or went meanwhile (the next reconcile decides again from what it is then)."""
    group, version, plural = queueing.WORKLOADS
    guarded = {**body, "metadata": {**body.get("metadata", {}), "resourceVersion": resource_version}}
    try:
        custom_api().patch_namespaced_custom_object(group, version, namespace, plural, name, guarded)
        return True
    except ApiException as err:
        if err.status in (404, 409):
            return False
        if err.status == 403:  # the chart grants patch with kueue.preemptionCost: a hand-made install may not
            log.warning("cannot set Kueue's priority boost on Workload %s/%s: %s", namespace, name, err.reason)
            return False
        raise


def patch_child_status(backend: Backend, namespace: str, job_name: str, body: dict) -> None:
    """A courtesy copy on the child's own status (TrainJob status.trainerStatus): never fails the
    TrainingJob's own status over it."""
    try:
        custom_api().patch_namespaced_custom_object_status(backend.group, backend.version, namespace, backend.plural,
                                                           naming.child_name(job_name), body)
    except ApiException as err:
        log.debug("progress not reported on the %s: %s", backend.kind, err.reason)


def patch_status(namespace: str, name: str, resource_version: str, fields: dict, plural: str = PLURAL) -> bool:
    """A merge patch of a TrainingJob's (or, by PLURAL, a TrainingSweep's) status, only if the object is
    still at RESOURCE_VERSION (the one the fields were decided from). False: it changed meanwhile (decide
    again); raises on others."""
    try:
        custom_api().patch_namespaced_custom_object_status(
            API_GROUP, API_VERSION, namespace, plural, name,
            {"metadata": {"resourceVersion": resource_version}, "status": fields})
        return True
    except ApiException as err:
        if err.status == 409:
            return False
        raise


# An Event's message longer than this is refused by the API server (1 KiB in events.k8s.io).
MAX_EVENT_MESSAGE = 1024


def post_event(body: dict, type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event about the TrainingJob BODY, posted with the operator's own client. Not
    kopf.event: that queues the event in the context of kopf's handler for the object, which the one
    timer's visits (look_again.py, on kopf's thread pool) do not run in; there it raised and the
    event was lost (e.g. a job learning from the timer that its queue does not exist)."""
    metadata = body["metadata"]
    timestamp = now()
    core_api().create_namespaced_event(metadata["namespace"], {
        "metadata": {"generateName": f"{metadata['name']}.", "namespace": metadata["namespace"]},
        "involvedObject": {"apiVersion": body.get("apiVersion", f"{API_GROUP}/{API_VERSION}"),
                           "kind": body.get("kind", KIND), "name": metadata["name"],
                           "namespace": metadata["namespace"], "uid": metadata.get("uid")},
        "type": type_, "reason": reason, "message": message[:MAX_EVENT_MESSAGE],
        "source": {"component": "kubetune-operator"}, "reportingComponent": "kubetune-operator",
        "reportingInstance": "kubetune-operator", "action": reason,
        "firstTimestamp": timestamp, "lastTimestamp": timestamp, "count": 1,
    })


def job_pods(namespace: str, child_name: str) -> list[dict]:
    """Every pod of a job's child, as plain dicts (camelCase, as the API server writes them)."""
    pods = core_api().list_namespaced_pod(namespace, label_selector=f"{naming.JOB_LABEL}={child_name}").items
    return [core_api().api_client.sanitize_for_serialization(pod) for pod in pods]
