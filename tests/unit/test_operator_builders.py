"""What the operator renders for a TrainingJob: ConfigMap, PyTorchJob, pod, status (pure functions)."""
import copy

import pytest
import yaml

from kubetune_api.manifest import parse_manifest
from kubetune_operator import naming
from kubetune_operator.backends import ChildState, PyTorchJobBackend
from kubetune_operator.backends.base import observed_state
from kubetune_operator.settings import Settings
from kubetune_operator.status import (final_checkpoint, latest_checkpoint_from_metrics, output_uri_from_metrics,
                                      progress_from_metrics, status_for_child)
from kubetune_operator.trainer_config import build_config_map

SETTINGS = Settings(trainer_image="registry.example/kubetune/trainer:1.2", s3_endpoint_url="http://s3.local:9000",
                    s3_region="eu-west-1")
UID = "0d7f7c1e-5a55-4a4e-9a1b-2a7b0f3c9e11"


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


def master(child):
    return child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]


def container(template):
    return template["spec"]["containers"][0]


def env_of(template):
    return {e["name"]: e for e in container(template)["env"]}


@pytest.mark.parametrize("nodes,gpus,cpu_processes,workers,nproc", [
    (1, 1, None, None, "1"), (1, 0, None, None, "1"), (3, 8, None, 2, "8"), (2, 0, None, 1, "1"), (2, 0, 2, 1, "2"),
    (1, 4, 4, None, "4"),
])
def test_replicas_and_processes_follow_the_resources(job_of, nodes, gpus, cpu_processes, workers, nproc):
    job = job_of(resources__nodes=nodes, resources__gpusPerNode=gpus,
                 **({"distributed__processesPerNode": cpu_processes} if cpu_processes else {}))
    child = PyTorchJobBackend().build(job, UID, SETTINGS)
    specs = child["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {}).get("replicas") == workers
    assert child["spec"]["nprocPerNode"] == nproc
    assert all(s["restartPolicy"] == "ExitCode" for s in specs.values())
    limits = container(master(child))["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)


def test_the_container_runs_the_trainer_entrypoint_with_the_config_map(job_of):
    job = job_of()
    child = PyTorchJobBackend().build(job, UID, SETTINGS)
    template = master(child)
    main = container(template)
    assert main["name"] == "pytorch" and main["image"] == SETTINGS.trainer_image
    assert main["command"] == ["python", "-m", "kubetune_trainer.pod"]
    assert main["args"] == ["--config", "/etc/kubetune/trainingjob.yaml"]
    assert {"name": "pytorchjob-port", "containerPort": naming.master_port(UID), "protocol": "TCP"} in main["ports"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == naming.config_map_name("sd15-lora-demo")
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}

    config_map = build_config_map(job)
    trainer_view = parse_manifest(yaml.safe_load(config_map["data"]["trainingjob.yaml"]))
    assert trainer_view.spec == job.spec


def test_s3_credentials_reach_pods_only_as_secret_references(job_of):
    job = job_of(s3={"credentialsSecret": "s3-creds", "pathStyle": True})
    child = PyTorchJobBackend().build(job, UID, SETTINGS)
    env = env_of(master(child))
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": key}}}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://s3.local:9000", "the chart's default applies"
    assert env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
    assert env["KUBETUNE_S3_PATH_STYLE"]["value"] == "true"
    config = build_config_map(job)["data"]["trainingjob.yaml"]
    assert "AWS_ACCESS_KEY_ID" not in config and "AWS_SECRET_ACCESS_KEY" not in config, "the config names the Secret only"


def test_without_a_secret_the_default_aws_chain_is_left_alone(job_of):
    env = env_of(master(PyTorchJobBackend().build(job_of(), UID, SETTINGS)))
    assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env


def test_every_pod_of_a_job_carries_its_uid_as_the_run_id(job_of):
    child = PyTorchJobBackend().build(job_of(resources__nodes=2), UID, SETTINGS)
    for replica in child["spec"]["pytorchReplicaSpecs"].values():
        assert env_of(replica["template"])["KUBETUNE_RUN_ID"]["value"] == UID, "restarts continue the same run"


def test_the_pod_passes_the_restricted_pod_security_standard(job_of):
    template = master(PyTorchJobBackend().build(job_of(), UID, SETTINGS))
    pod, main = template["spec"], container(template)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False, "the trainer never calls the Kubernetes API"
    # Its own volumes are configMap and emptyDir; the example's (spec.volumes) are claims, which the
    # restricted standard allows too (an NFS or hostPath volume of a job is the cluster's to allow).
    own = {v.name for v in job_of().spec.volumes}
    assert all(set(v) - {"name"} <= {"configMap", "emptyDir"} for v in pod["volumes"] if v["name"] not in own)
    assert all(set(v) - {"name"} == {"persistentVolumeClaim"} for v in pod["volumes"] if v["name"] in own) and own
    assert "hostNetwork" not in pod and "hostPID" not in pod


def test_scheduling_fields_pass_through(job_of):
    scheduling = {
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
        "priorityClassName": "training", "queueName": "team-a-queue", "serviceAccountName": "trainer",
        "imagePullSecrets": ["regcred"], "workloadPriorityClass": "research",
    }
    child = PyTorchJobBackend().build(job_of(scheduling=scheduling), UID, SETTINGS)
    pod = master(child)["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == scheduling["tolerations"]
    assert pod["affinity"] == scheduling["affinity"]
    assert pod["priorityClassName"] == "training" and pod["serviceAccountName"] == "trainer"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert child["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-queue"
    assert child["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "research"


def test_run_policy_maps_suspend_deadline_and_ttl(job_of):
    child = PyTorchJobBackend().build(
        job_of(suspend=True, runPolicy={"activeDeadlineSeconds": 3600, "ttlSecondsAfterFinished": 60, "backoffLimit": 5}),
        UID, SETTINGS)
    assert child["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "backoffLimit": 5, "suspend": True,
                                          "activeDeadlineSeconds": 3600, "ttlSecondsAfterFinished": 60}
    assert PyTorchJobBackend().suspend_patch(False) == {"spec": {"runPolicy": {"suspend": False}}}


@pytest.mark.parametrize("name", ["a", "x" * 40, "x" * 41, "very-long-team-name-fine-tune-of-the-month." * 5][:4])
def test_child_names_fit_service_name_limits(name):
    child = naming.child_name(name)
    assert len(f"{child}-worker-1023") <= 63
    assert naming.child_name(name) == child, "stable"
    if len(name) > naming.MAX_CHILD_NAME:
        assert child != naming.child_name(name + "y"), "distinct names stay distinct"


@pytest.mark.parametrize("conditions,phase", [
    ([], "Pending"),
    ([{"type": "Created", "status": "True"}], "Pending"),
    ([{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}], "Running"),
    ([{"type": "Running", "status": "False"}, {"type": "Succeeded", "status": "True"}], "Succeeded"),
    ([{"type": "Running", "status": "False"}, {"type": "Failed", "status": "True", "message": "OOM"}], "Failed"),
    ([{"type": "Suspended", "status": "True"}], "Suspended"),
    ([{"type": "Restarting", "status": "True"}], "Running"),
])
def test_child_conditions_map_to_a_phase(conditions, phase):
    assert PyTorchJobBackend().read_state({"status": {"conditions": conditions}}).phase == phase


@pytest.mark.parametrize("conditions", [[], [{"type": "Created", "status": "True"}]])
def test_a_child_created_suspended_is_suspended_before_its_controller_says_so(conditions):
    """A suspended job's phase is ours to write at once, not after the training operator's work queue."""
    child = {"spec": {"runPolicy": {"suspend": True}}, "status": {"conditions": conditions}}
    assert observed_state(PyTorchJobBackend(), child).phase == "Suspended"
    resumed = {"spec": {"runPolicy": {"suspend": False}}, "status": {"conditions": conditions}}
    assert observed_state(PyTorchJobBackend(), resumed).phase == "Pending"
    # What the controller reports wins once it reports more than "created".
    running = {"spec": {"runPolicy": {"suspend": True}},
               "status": {"conditions": [{"type": "Running", "status": "True"}]}}
    assert observed_state(PyTorchJobBackend(), running).phase == "Running"


def test_a_transition_sets_phase_conditions_times_and_one_event():
    patch, events = status_for_child({"phase": "Pending"}, ChildState("Running", "Running", "pods up", "T0"), "T1")
    assert patch["phase"] == "Running" and patch["startTime"] == "T0"
    assert {c["type"]: c["status"] for c in patch["conditions"]}["Running"] == "True"
    assert [(e.type, e.reason) for e in events] == [("Normal", "Running")]

    current = {"phase": "Running", "startTime": "T0", "conditions": patch["conditions"]}
    again, events = status_for_child(current, ChildState("Running", "Running", "pods up", "T0"), "T2")
    assert again == {} and events == [], "no change, no patch (level-based)"

    failed, events = status_for_child(current, ChildState("Failed", "BackoffLimit", "exit 2"), "T3")
    assert failed["phase"] == "Failed" and failed["completionTime"] == "T3"
    assert events[0].type == "Warning" and events[0].message == "exit 2"


def test_finished_jobs_ignore_late_child_updates():
    assert status_for_child({"phase": "Succeeded"}, ChildState("Running"), "T") == ({}, [])


def test_progress_comes_from_the_trainer_gauges():
    progress = progress_from_metrics({"step": 25, "planned_steps": 100, "loss": 0.1234567, "recent_loss": 0.25,
                                      "eta_seconds": 30.04})
    assert progress == {"step": 25, "totalSteps": 100, "percent": 25.0, "loss": 0.123457, "recentLoss": 0.25,
                        "etaSeconds": 30.0}
    assert progress_from_metrics({"loss": 1.0}) is None


def test_an_enabled_cache_is_filled_by_the_master_before_training(job_of):
    # A model in S3: a hub model adds the models stage before the cache (tests/unit/test_hub_models.py).
    child = PyTorchJobBackend().build(job_of(resources__nodes=2, data__cache={"enabled": True},
                                             model__pretrained="s3://models/sd15"), UID, SETTINGS)
    master_init = master(child)["spec"]["initContainers"]
    assert [c["name"] for c in master_init] == ["cache"]
    assert master_init[0]["args"][-1] == "--cache-only"
    assert master_init[0]["securityContext"] == container(master(child))["securityContext"]
    worker = child["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert "initContainers" not in worker
    plain = PyTorchJobBackend().build(job_of(), UID, SETTINGS)
    assert "initContainers" not in master(plain)["spec"]


def test_the_run_directory_and_latest_checkpoint_come_from_the_trainer_and_are_certain_at_success():
    run = output_uri_from_metrics({"run_version": 2}, "s3://b/runs/", "team-a", "x")
    assert run == "s3://b/runs/team-a/x/v2"
    assert output_uri_from_metrics({"step": 3}, "s3://b/runs", "team-a", "x") is None, "not reported yet"
    assert latest_checkpoint_from_metrics({"last_checkpoint_step": 500}, run) == "s3://b/runs/team-a/x/v2/checkpoint-500"
    assert latest_checkpoint_from_metrics({"last_checkpoint_step": 0}, run) is None
    assert latest_checkpoint_from_metrics({"last_checkpoint_step": 5}, None) is None
    spec = {"checkpoints": {"uri": "s3://b/runs"}, "training": {"maxSteps": 1000}}
    assert final_checkpoint(spec, {"outputUri": run}) == f"{run}/checkpoint-1000"
    assert final_checkpoint(spec, {"outputUri": run, "progress": {"totalSteps": 60}}) == f"{run}/checkpoint-60"
    assert final_checkpoint(spec, {}) is None, "the run's version was never reported"
    early = {**spec, "validation": {"earlyStoppingPatience": 3}}
    assert final_checkpoint(early, {}) is None, "an early stop may end sooner: keep the reported one"


# ---- requests, limits and volume sizes: no BestEffort pod, no unbounded scratch volume -----------

DEFAULTED = Settings(default_cpu_per_process="2", default_memory_per_process="8Gi", cache_size_limit="100Gi")


def _volumes(template):
    return {v["name"]: v for v in template["spec"]["volumes"]}


def test_cpu_and_memory_a_job_leaves_out_are_requested_per_process_without_a_limit(job_of):
    job = job_of(resources__gpusPerNode=4)
    resources = container(master(PyTorchJobBackend().build(job, UID, DEFAULTED)))["resources"]
    assert resources["requests"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "4"}, "4 processes, one per GPU"
    assert resources["limits"] == {"nvidia.com/gpu": "4"}, "a coarse default never OOM-kills a run"

    exact = job_of(resources__gpusPerNode=0, resources__cpu="6", resources__memory="20Gi")
    resources = container(master(PyTorchJobBackend().build(exact, UID, DEFAULTED)))["resources"]
    assert resources == {"requests": {"cpu": "6", "memory": "20Gi"}, "limits": {"cpu": "6", "memory": "20Gi"}}

    cpu_processes = job_of(resources__gpusPerNode=0, distributed__processesPerNode=3)
    requests = container(master(PyTorchJobBackend().build(cpu_processes, UID, DEFAULTED)))["resources"]["requests"]
    assert requests == {"cpu": "6", "memory": "24Gi"}
    none = container(master(PyTorchJobBackend().build(cpu_processes, UID, Settings())))["resources"]
    assert none == {}, "no defaults configured: nothing is added"


def test_the_cache_volume_is_size_limited_and_a_declared_cache_size_is_requested(job_of):
    template = master(PyTorchJobBackend().build(job_of(), UID, DEFAULTED))
    volumes = _volumes(template)
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "100Gi"}
    assert volumes["tmp"]["emptyDir"]["sizeLimit"] and volumes["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"
    assert "ephemeral-storage" not in container(template)["resources"].get("requests", {})

    declared = master(PyTorchJobBackend().build(job_of(resources__cacheSize="300Gi"), UID, DEFAULTED))
    assert _volumes(declared)["cache"]["emptyDir"] == {"sizeLimit": "300Gi"}
    assert container(declared)["resources"]["requests"]["ephemeral-storage"] == "300Gi"
    assert "ephemeral-storage" not in container(declared)["resources"].get("limits", {})


def test_a_trainjob_gets_the_same_requests_and_cache_limit(job_of):
    from kubetune_operator.backends import TrainJobBackend

    train_job = TrainJobBackend().build(job_of(resources__cacheSize="50Gi"), UID, DEFAULTED)
    assert train_job["spec"]["trainer"]["resourcesPerNode"]["requests"] == {
        "cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1", "ephemeral-storage": "50Gi"}
    patch = train_job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    volumes = {v["name"]: v for v in patch["template"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "50Gi"}


@pytest.mark.parametrize("variable,helm_value", [("KUBETUNE_DEFAULT_CPU_PER_PROCESS", "trainer.defaultRequests.cpuPerProcess"),
                                                 ("KUBETUNE_DEFAULT_MEMORY_PER_PROCESS", "trainer.defaultRequests.memoryPerProcess"),
                                                 ("KUBETUNE_CACHE_SIZE_LIMIT", "trainer.cacheSizeLimit")])
def test_a_malformed_default_stops_the_operator_naming_the_helm_value(variable, helm_value):
    with pytest.raises(ValueError, match=helm_value):
        Settings.from_env({variable: "eight gigs"})


def test_the_api_token_is_mounted_only_for_a_job_that_asks_for_it(job_of):
    from kubetune_operator.backends import TrainJobBackend
    from kubetune_operator.pod_template import SERVICE_ACCOUNT_DIR

    plain = master(PyTorchJobBackend().build(job_of(), UID, SETTINGS))
    assert plain["spec"]["automountServiceAccountToken"] is False
    assert SERVICE_ACCOUNT_DIR not in {m["mountPath"] for m in container(plain)["volumeMounts"]}

    asks = job_of(scheduling={"serviceAccountName": "trainer-identity", "serviceAccountToken": True},
                  data__cache={"enabled": True}, volumes=[])  # the token's mount alone (test_volumes: the job's)
    template = master(PyTorchJobBackend().build(asks, UID, SETTINGS))
    token = _volumes(template)["kube-api-access"]["projected"]["sources"]
    assert token[0]["serviceAccountToken"]["expirationSeconds"] <= 3607, "a bound, expiring token"
    for c in [container(template), *template["spec"]["initContainers"]]:  # the cache stage too
        assert {"name": "kube-api-access", "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True} in c["volumeMounts"]

    patch = TrainJobBackend().build(asks, UID, SETTINGS)["spec"]["runtimePatches"][0]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "kube-api-access" in {v["name"] for v in pod["volumes"]}
    assert pod["containers"] == [{"name": "node", "volumeMounts": [
        {"name": "kube-api-access", "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}]}]
