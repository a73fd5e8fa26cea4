"""The backend seam and the TrainJob backend (Kubeflow Trainer v2.3): pure builders and decisions."""
from __future__ import annotations

import copy
import re

import pytest

from kubetune_api.manifest import parse_manifest
from kubetune_operator import backend_check, naming
from kubetune_operator.backends import BACKENDS, PyTorchJobBackend, TrainJobBackend, backend_name, operator_settings
from kubetune_operator.backends.base import observed_state
from kubetune_operator.backends.trainjob import RETRYABLE_EXIT_CODES, RuntimeValues, runtime
from kubetune_operator.settings import Settings
from tests.conftest import REPO

SETTINGS = Settings(trainer_image="registry.example/kubetune/trainer:1.2", s3_endpoint_url="http://s3.local:9000",
                    s3_region="eu-west-1", backend="trainjob", backends=("trainjob", "pytorchjob"))
UID = "0d7f7c1e-5a55-4a4e-9a1b-2a7b0f3c9e11"
TRAINJOB = TrainJobBackend()


@pytest.fixture
def job_of(example_manifest):
    def make(**spec_changes):
        manifest = copy.deepcopy(example_manifest)
        manifest["metadata"]["namespace"] = "team-a"
        for dotted, value in spec_changes.items():
            node = manifest["spec"]
            *parents, last = dotted.split("__")
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        return parse_manifest(manifest)
    return make


def runtime_pod(values: RuntimeValues = RuntimeValues()) -> dict:
    return runtime(values)["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def pod_patch(train_job: dict) -> dict:
    patch = train_job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    return patch["template"]["spec"]["template"]


# ---- the seam: backends by name ------------------------------------------------------------------

def test_backends_are_registered_by_the_names_spec_backend_and_the_chart_use():
    assert set(BACKENDS) == {"pytorchjob", "trainjob"}
    assert all(name == backend.name for name, backend in BACKENDS.items())


@pytest.mark.parametrize("spec,status,default,chosen", [
    ({}, {}, "pytorchjob", "pytorchjob"),
    ({}, {}, "trainjob", "trainjob"),
    ({"backend": "trainjob"}, {}, "pytorchjob", "trainjob"),
    # A started job keeps its backend when the operator's default changes (a helm upgrade).
    ({}, {"backend": "pytorchjob"}, "trainjob", "pytorchjob"),
    # Started before status.backend existed: a PyTorchJob, the only backend then.
    ({}, {"phase": "Running"}, "trainjob", "pytorchjob"),
], ids=["default", "other-default", "per-job", "kept-after-upgrade", "started-before-backends"])
def test_a_job_gets_the_backend_it_started_with_else_asks_for_else_the_default(spec, status, default, chosen):
    assert backend_name(spec, status, default) == chosen


def test_nothing_outside_the_backend_modules_names_a_kubeflow_label_container_or_variable():
    operator = REPO / "operator" / "src" / "kubetune_operator"
    leaks = re.compile(r"training\.kubeflow\.org|jobset\.sigs|\"pytorch\"|pytorchjob-port|MASTER_ADDR|PET_|"
                       r"replica-type|job-completion-index")
    for source in [*operator.glob("*.py")]:
        found = leaks.findall(source.read_text())
        assert not found, f"{source.name} names {found}: that belongs in a backend module"


@pytest.mark.parametrize("backend,selector", [
    (PyTorchJobBackend(), "training.kubeflow.org/job-name=sd15-lora-demo,training.kubeflow.org/replica-type=master"),
    (TrainJobBackend(), "jobset.sigs.k8s.io/jobset-name=sd15-lora-demo,jobset.sigs.k8s.io/replicatedjob-name=node,"
                        "batch.kubernetes.io/job-completion-index=0"),
], ids=["pytorchjob", "trainjob"])
def test_each_backend_finds_the_pod_that_runs_rank_0(backend, selector):
    assert backend.rank0_pod_selector("sd15-lora-demo") == selector


# ---- the TrainJob ----------------------------------------------------------------------------------

def test_a_trainjob_references_the_runtime_and_overrides_the_trainer(job_of):
    job = job_of(resources__nodes=2, resources__gpusPerNode=4)
    train_job = TRAINJOB.build(job, UID, SETTINGS)
    assert (train_job["apiVersion"], train_job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert train_job["metadata"]["name"] == naming.child_name("sd15-lora-demo")
    spec = train_job["spec"]
    assert spec["runtimeRef"] == {"name": "kubetune-trainer", "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}
    assert spec["suspend"] is False
    trainer = spec["trainer"]
    assert trainer["image"] == SETTINGS.trainer_image
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["resourcesPerNode"] == {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    assert "args" not in trainer, "the runtime's entry point, unchanged"


@pytest.mark.parametrize("gpus,cpu_processes,nproc", [(0, None, 1), (0, 3, 3), (8, None, 8)])
def test_processes_per_node_are_always_explicit(job_of, gpus, cpu_processes, nproc):
    """The Trainer's default "auto" would start one process per CPU core of a CPU node."""
    job = job_of(resources__gpusPerNode=gpus, **({"distributed__processesPerNode": cpu_processes}
                                                   if cpu_processes else {}))
    assert TRAINJOB.build(job, UID, SETTINGS)["spec"]["trainer"]["numProcPerNode"] == nproc


def test_a_trainjob_pod_gets_the_same_environment_as_a_pytorchjob_pod(job_of):
    job = job_of(s3={"credentialsSecret": "s3-creds", "pathStyle": True})
    pytorchjob_env = PyTorchJobBackend().build(job, UID, SETTINGS)["spec"]["pytorchReplicaSpecs"]["Master"][
        "template"]["spec"]["containers"][0]["env"]
    trainjob_env = TRAINJOB.build(job, UID, SETTINGS)["spec"]["trainer"]["env"]
    assert trainjob_env == pytorchjob_env
    names = [e["name"] for e in trainjob_env]
    assert names.index("POD_IP") < names.index("KUBETUNE_METRICS_ADDR"), "$(POD_IP) needs POD_IP above it"
    cpu = {e["name"]: e["valueFrom"]["resourceFieldRef"] for e in trainjob_env if "resourceFieldRef" in e.get("valueFrom", {})}
    assert cpu == {"KUBETUNE_CPU_REQUEST_MILLICORES": {"resource": "requests.cpu", "divisor": "1m"},
                   "KUBETUNE_CPU_LIMIT_MILLICORES": {"resource": "limits.cpu", "divisor": "1m"}}, \
        "the trainer sizes its CPU threads from the container's own request and limit"
    secret = next(e for e in trainjob_env if e["name"] == "AWS_SECRET_ACCESS_KEY")
    assert secret == {"name": "AWS_SECRET_ACCESS_KEY",
                      "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}}}


def test_the_runtime_patch_mounts_this_jobs_config_and_sets_its_pods_placement(job_of):
    scheduling = {"nodeSelector": {"gpu": "h100"}, "serviceAccountName": "trainer", "imagePullSecrets": ["regcred"],
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                  "queueName": "team-a-queue", "workloadPriorityClass": "research"}
    train_job = TRAINJOB.build(job_of(scheduling=scheduling, resources__shmSize="8Gi"), UID, SETTINGS)
    assert train_job["spec"]["runtimePatches"][0]["manager"] == "kubetune.dev/operator"
    template = pod_patch(train_job)
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["config"] == {"name": "config", "configMap": {"name": naming.config_map_name("sd15-lora-demo")}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert template["spec"]["nodeSelector"] == {"gpu": "h100"} and template["spec"]["serviceAccountName"] == "trainer"
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert template["spec"]["tolerations"] == scheduling["tolerations"]
    assert template["metadata"]["labels"] == naming.labels("sd15-lora-demo")
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # Kueue reads the queue from the TrainJob itself (its TrainJob integration).
    assert train_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-queue"
    assert train_job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "research"


def test_suspend_deadline_and_the_cache_stage_reach_the_trainjob(job_of):
    train_job = TRAINJOB.build(job_of(suspend=True, runPolicy={"activeDeadlineSeconds": 3600},
                                      data__cache={"enabled": True}), UID, SETTINGS)
    assert train_job["spec"]["suspend"] is True and train_job["spec"]["activeDeadlineSeconds"] == 3600
    # One pod template for all nodes: node 0 fills the cache in its main container, which holds the GPUs.
    assert train_job["spec"]["trainer"]["args"] == ["--config", "/etc/kubetune/trainingjob.yaml", "--cache-stage"]
    assert TRAINJOB.suspend_patch(False) == {"spec": {"suspend": False}}


@pytest.mark.parametrize("conditions,jobs_status,phase,reason", [
    ([], [], "Pending", "Created"),
    ([], [{"name": "node", "active": 1, "ready": 0}], "Running", "Running"),
    ([], [{"name": "node", "active": 0, "ready": 1}], "Running", "Running"),
    ([{"type": "Suspended", "status": "True", "reason": "Suspended"}], [{"name": "node", "suspended": 1}],
     "Suspended", "Suspended"),
    ([{"type": "Suspended", "status": "False", "reason": "Resumed"}], [{"name": "node", "active": 1}],
     "Running", "Running"),
    ([{"type": "Complete", "status": "True", "reason": "AllJobsCompleted", "lastTransitionTime": "T9"}], [],
     "Succeeded", "AllJobsCompleted"),
    ([{"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "node failed"}], [],
     "Failed", "FailedJobs"),
    ([{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"},
      {"type": "Suspended", "status": "True"}], [], "Failed", "DeadlineExceeded"),
], ids=["created", "pods-starting", "pods-ready", "suspended", "resumed", "complete", "failed", "failed-wins"])
def test_trainjob_state_maps_to_a_phase(conditions, jobs_status, phase, reason):
    state = TRAINJOB.read_state({"status": {"conditions": conditions, "jobsStatus": jobs_status}})
    assert (state.phase, state.reason) == (phase, reason)


def test_a_trainjob_created_suspended_is_suspended_before_the_trainer_says_so():
    assert observed_state(TRAINJOB, {"spec": {"suspend": True}, "status": {}}).phase == "Suspended"
    assert observed_state(TRAINJOB, {"spec": {"suspend": False}, "status": {}}).phase == "Pending"


def test_a_finished_trainjob_reports_when_it_finished():
    state = TRAINJOB.read_state({"status": {"conditions": [
        {"type": "Complete", "status": "True", "reason": "AllJobsCompleted", "lastTransitionTime": "T9"}]}})
    assert state.completion_time == "T9"


@pytest.mark.parametrize("child,suspended", [({"spec": {"suspend": True}}, True), ({"spec": {"suspend": False}}, False),
                                             ({"spec": {}}, False), ({}, False)])
def test_a_trainjob_is_suspended_when_its_spec_says_so(child, suspended):
    assert TRAINJOB.is_suspended(child) is suspended


def test_a_trainjob_is_replaced_not_patched_to_change_size(job_of):
    """JobSet refuses a new parallelism for a replicated job, even suspended: delete and build again."""
    assert TRAINJOB.resize_patch({"spec": {"suspend": True}}, job_of(), UID, SETTINGS) is None


@pytest.mark.parametrize("changes,messages", [
    ({}, []),
    ({"scheduling": {"priorityClassName": "high"}},
     ["spec.scheduling.priorityClassName: a TrainJob (Kubeflow Trainer v2.3) cannot set a pod priority per job; "
      "use a Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class) or spec.backend pytorchjob"]),
    ({"runPolicy": {"ttlSecondsAfterFinished": 60}},
     ["spec.runPolicy.ttlSecondsAfterFinished: a TrainJob (Kubeflow Trainer v2.3) has no per-job TTL; remove it "
      "or use spec.backend pytorchjob"]),
    ({"runPolicy": {"backoffLimit": 7}},
     ["spec.runPolicy.backoffLimit 7: TrainJobs restart as often as their ClusterTrainingRuntime allows (3, Helm "
      "value trainjob.runtime.maxRestarts); leave it unset or use spec.backend pytorchjob"]),
    ({"runPolicy": {"backoffLimit": 3}}, []),
], ids=["nothing", "priority-class", "ttl", "backoff-limit", "backoff-limit-as-runtime"])
def test_fields_a_trainjob_cannot_honour_are_refused_by_name(job_of, changes, messages):
    assert TRAINJOB.unsupported(job_of(**changes), Settings()) == messages
    assert PyTorchJobBackend().unsupported(job_of(**changes), Settings()) == []


def test_progress_is_also_reported_in_the_trainjobs_own_status_field():
    patch = TRAINJOB.progress_patch({"step": 25, "totalSteps": 100, "percent": 25.0, "loss": 0.12,
                                     "etaSeconds": 30.4}, "T1", Settings())
    assert patch == {"status": {"trainerStatus": {
        "progressPercentage": 25, "estimatedRemainingSeconds": 30, "lastUpdatedTime": "T1",
        "metrics": [{"name": "step", "value": "25"}, {"name": "totalSteps", "value": "100"},
                    {"name": "loss", "value": "0.12"}]}}}
    assert PyTorchJobBackend().progress_patch({"step": 1}, "T1", Settings()) is None
    # The TrainJob backend's own setting (Helm value trainjob.reportProgress), parsed by its module.
    off = operator_settings({"KUBETUNE_TRAINJOB_REPORT_PROGRESS": "false"})
    assert TRAINJOB.progress_patch({"step": 1}, "T1", off) is None


# ---- the ClusterTrainingRuntime -------------------------------------------------------------------

def test_the_runtimes_pod_is_a_pytorchjob_pod_less_what_each_job_sets(job_of):
    """Same entry point, security context, mounts, volumes and grace period as today's PyTorchJob pods."""
    # The job's own volumes (spec.volumes) come with each TrainJob's patch, not the runtime.
    master = PyTorchJobBackend().build(job_of(volumes=[]), UID, Settings())["spec"]["pytorchReplicaSpecs"]["Master"]
    master = master["template"]
    reference, pod = master["spec"], runtime_pod()
    for key in ("securityContext", "automountServiceAccountToken", "terminationGracePeriodSeconds"):
        assert pod[key] == reference[key], key
    ours, theirs = pod["containers"][0], reference["containers"][0]
    assert ours["name"] == "node", "the container the Trainer's torch plugin injects PET_* into"
    for key in ("command", "args", "securityContext", "volumeMounts"):
        assert ours[key] == theirs[key], key
    assert ours["ports"] == [p for p in theirs["ports"] if p["name"] == "metrics"], "the Trainer adds the rendezvous port"
    assert [v["name"] for v in pod["volumes"]] == [v["name"] for v in reference["volumes"]]
    assert "initContainers" not in pod, "an init container would get no GPU: the cache stage runs in the main one"


def test_the_runtime_passes_the_restricted_pod_security_standard():
    pod = runtime_pod()
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert all(set(v) - {"name"} <= {"configMap", "emptyDir"} for v in pod["volumes"])


def test_the_runtime_uses_the_torch_policy_and_restarts_only_what_a_restart_can_fix():
    built = runtime(RuntimeValues(max_restarts=5))
    assert built["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}
    jobset = built["spec"]["template"]["spec"]
    assert jobset["network"] == {"enableDNSHostnames": True}, "PET_MASTER_ADDR names rank 0's pod"
    assert jobset["failurePolicy"]["maxRestarts"] == 5
    assert jobset["failurePolicy"]["rules"] == [{"name": "failOnTrainerError", "action": "FailJobSet",
                                                 "onJobFailureReasons": ["PodFailurePolicy"]}]
    node = jobset["replicatedJobs"][0]
    assert node["name"] == "node"
    assert node["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    job = node["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    assert job["podFailurePolicy"]["rules"] == [{"action": "FailJob",
                                                 "onExitCodes": {"operator": "NotIn", "values": RETRYABLE_EXIT_CODES}}]
    assert 143 in RETRYABLE_EXIT_CODES, "SIGTERM after the last checkpoint (preemption) restarts, never fails"
    assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_the_charts_runtime_template_is_generated_from_the_pod_template():
    from kubetune_operator.runtime_chart import CHART_TEMPLATE, chart_template

    assert CHART_TEMPLATE.read_text() == chart_template(), \
        "run `python -m kubetune_operator.runtime_chart --write` (or scripts/render-manifests.sh)"


# ---- can the backend run the job? (BackendReady) -----------------------------------------------

def test_a_backend_the_operator_was_installed_without_is_named_with_the_helm_value_that_enables_it():
    problem = backend_check.not_enabled(TRAINJOB, Settings())
    assert problem.reason == "BackendNotEnabled" and not problem.permanent
    assert problem.message == (
        "spec.backend trainjob: this kubetune operator was installed without the trainjob backend (enabled: "
        "pytorchjob); enable it with helm upgrade kubetune charts/kubetune --reuse-values --set trainjob.enabled=true, "
        "and the job starts")
    assert backend_check.not_enabled(PyTorchJobBackend(), Settings()) is None


def test_a_refused_field_is_a_permanent_problem_naming_the_backend(job_of):
    problem = backend_check.unsupported(job_of(runPolicy={"ttlSecondsAfterFinished": 1}), TRAINJOB, Settings())
    assert problem.permanent and problem.reason == "UnsupportedByBackend"
    assert problem.message.startswith("the trainjob backend cannot run this job: spec.runPolicy.ttlSecondsAfterFinished")


@pytest.mark.parametrize("prerequisite,reason,says", [
    (0, "TrainJobAPIMissing", "the TrainJob API (trainjobs.trainer.kubeflow.org/v1alpha1) is not installed: install "
                              "Kubeflow Trainer v2.3 with JobSet: helm install kubeflow-trainer "
                              "oci://ghcr.io/kubeflow/charts/kubeflow-trainer --version 2.3.0"),
    (1, "TrainingRuntimeMissing", "ClusterTrainingRuntime 'kubetune-trainer' does not exist: the kubetune chart ships "
                                  "it with the TrainJob backend (helm upgrade kubetune charts/kubetune --reuse-values "
                                  "--set trainjob.enabled=true)"),
], ids=["api", "runtime"])
def test_what_a_trainjob_needs_installed_says_how_to_install_it(prerequisite, reason, says):
    need = TRAINJOB.prerequisites(Settings())[prerequisite]
    problem = backend_check.missing(need)
    assert problem.reason == reason and says in problem.message and not problem.permanent


def test_the_condition_says_what_stops_the_job_then_that_its_child_exists():
    problem = backend_check.Problem("TrainJobAPIMissing", "the TrainJob API is not installed")
    waiting = backend_check.conditions({}, problem, TRAINJOB, "", "T0")
    assert [(c["type"], c["status"], c["reason"], c["message"]) for c in waiting] == [
        ("BackendReady", "False", "TrainJobAPIMissing", "the TrainJob API is not installed")]
    ready = backend_check.conditions({"conditions": waiting}, None, TRAINJOB, "sd15", "T1")
    assert [(c["status"], c["reason"], c["message"], c["lastTransitionTime"]) for c in ready] == [
        ("True", "ChildCreated", "TrainJob sd15 (trainjob backend)", "T1")]


# ---- settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("env,backend,backends", [
    ({}, "pytorchjob", ("pytorchjob",)),
    ({"KUBETUNE_BACKEND": "trainjob", "KUBETUNE_BACKENDS": "trainjob"}, "trainjob", ("trainjob",)),
    ({"KUBETUNE_BACKEND": "trainjob", "KUBETUNE_BACKENDS": "pytorchjob,trainjob"}, "trainjob",
     ("trainjob", "pytorchjob")),
    ({"KUBETUNE_BACKEND": "trainjob"}, "trainjob", ("trainjob",)),  # the default is always enabled
])
def test_the_operator_reads_its_backends_from_the_chart(env, backend, backends):
    settings = Settings.from_env(env)
    assert (settings.backend, settings.backends) == (backend, backends)


def test_an_unknown_backend_stops_the_operator_naming_the_helm_value():
    with pytest.raises(ValueError, match=r"KUBETUNE_BACKEND\(S\) \(Helm value backend\): unknown backend 'mpijob'; "
                                         r"use pytorchjob or trainjob"):
        Settings.from_env({"KUBETUNE_BACKEND": "mpijob"})
