"""The operator on the local control plane: helm install, kubectl apply a TrainingJob, watch it train.

The operator runs as a pod of the chart (through the process kubelet), the trainer as the pods
of the child job it creates; model, data, checkpoints and the LoRA live in the local S3 server.
Every test that installs the operator runs once per backend (the `backend` fixture): PyTorchJob
(Training Operator v1.9) and TrainJob (Kubeflow Trainer v2.3 on JobSet), except where the backend's
code is never reached or another test already runs the same backend path on both: those run on one
backend (`ONLY_ON_*`, each with the reason), some on each, so that both stay covered.
"""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from PIL import Image

from kubetune_api.contract import read_final_report
from kubetune_operator.pod_template import NON_ROOT_UID
from tests.conftest import REPO
from kubetune_trainer.data.tiny_data import write_tiny_data
from kubetune_trainer.models.tiny_models import write_tiny_model
from tests.e2e.jobs import (BUCKET, OPERATOR_NAMESPACE, backend_of, children, example_job, get_child, get_job,
                            job_pods, kubectl, operator_log, os_env, phase, printed_columns, rank0_pod, rank0_pod_logs)
from tests.e2e.waiting import eventually
from tests.unit.test_spec_validation import BAD_INPUTS, with_change

pytestmark = pytest.mark.e2e
# The operator of such a test runs this backend only (the module's `backend` fixture, narrowed).
ONLY_ON_PYTORCHJOB = pytest.mark.parametrize("backend", ["pytorchjob"], indirect=True)
ONLY_ON_TRAINJOB = pytest.mark.parametrize("backend", ["trainjob"], indirect=True)


def kubetune_cli(env: dict, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "kubetune_cli.main", *args], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_an_applied_example_trains_to_succeeded_and_its_lora_lands_in_s3(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3, s3, tmp_path):
    """Over a minute on TrainJob: the README's main path, a 30-step run watched while it trains (status.progress
    moving), then its LoRA, report and metrics in S3."""
    manifest = example_job(inputs_in_s3, "sd15-e2e", "runs/sd15-e2e", maxSteps=30)
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    # A child job of the backend's kind, owned by the TrainingJob, appears.
    child = eventually(lambda: get_child(api_client, backend, job_namespace, "sd15-e2e"), timeout=60,
                       message=lambda: f"{backend} created; operator log:\n" + operator_log(control_plane, core))
    owner = child["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "TrainingJob" and owner["name"] == "sd15-e2e" and owner["controller"] is True

    # While it runs, status.progress follows the trainer and `kubectl get tj` shows it.
    def running_with_progress():
        status = get_job(api_client, job_namespace, "sd15-e2e").get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            pytest.fail(f"finished before progress was seen: {json.dumps(status)}\n" + operator_log(control_plane, core))
        return status.get("phase") == "Running" and (status.get("progress") or {}).get("step", 0) > 0

    eventually(running_with_progress, timeout=300, interval=1,
               message=lambda: "progress while running; operator log:\n" + operator_log(control_plane, core))
    # A user follows the trainer's output as on any cluster (API server -> the kubelet's API).
    trainer_pod = rank0_pod(core, backend, job_namespace, "sd15-e2e")
    following = subprocess.Popen([*control_plane.kubectl_argv(), "logs", "-f", trainer_pod, "-n", job_namespace,
                                  "-c", backend_of(backend).container], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    explained = kubectl(control_plane, "explain", "trainingjob.spec.training").stdout
    assert "learningRate" in explained and "Peak learning rate" in explained
    table = kubectl(control_plane, "get", "tj", "sd15-e2e", "-n", job_namespace).stdout.splitlines()
    row = printed_columns(table[0], table[1])
    assert row["PHASE"] in ("Running", "Succeeded") and 0 < int(row["STEP"]) <= 30
    assert float(row["PROGRESS"]) > 0 and float(row["LOSS"]) > 0

    final = eventually(lambda: phase(api_client, job_namespace, "sd15-e2e") in ("Succeeded", "Failed")
                       and get_job(api_client, job_namespace, "sd15-e2e"), timeout=600, interval=2,
                       message="TrainingJob finished")
    logs = rank0_pod_logs(control_plane, backend, job_namespace, "sd15-e2e")
    assert final["status"]["phase"] == "Succeeded", logs[-1][-3000:] if logs else "no trainer log"
    followed, errors = following.communicate(timeout=60)  # `-f` ends with the container
    assert following.returncode == 0 and followed == logs[-1] and "step 30/30" in followed, errors
    if backend == "trainjob":
        assert sdk_job_logs(control_plane, job_namespace, child["metadata"]["name"]) == logs[-1].splitlines()
    # This release requests one CPU per process; the pod reads it through the downward API.
    assert "(1 process(es), 1 CPU thread(s) each)" in logs[-1], logs[-1][-3000:]
    # Progress came by push (the chart's default): rank 0 POSTed its gauges to the operator's
    # progress Service, which accepts them only from the job's rank-0 pod, and its final gauges
    # too, so the status holds the last step's loss, not the reading of some steps before the end.
    assert "progress pushed to http://kubetune-progress.kubetune-system.svc:9401/progress/" in logs[-1], \
        logs[-1][-3000:]
    assert "the operator has the final metrics (pushed to its progress inbox)" in logs[-1], logs[-1][-3000:]
    last_loss = float(re.findall(r"step 30/30 loss ([\d.]+)", logs[-1])[-1])
    assert final["status"]["progress"]["loss"] == pytest.approx(last_loss, abs=1e-5)
    # The same last reading outlives the pod: rank 0's termination message, kept in its status.
    rank0 = core.list_namespaced_pod(job_namespace, label_selector=backend_of(backend).rank0_pod_selector(
        "sd15-e2e")).items
    reports = [read_final_report(c.state.terminated.message) for p in rank0 for c in p.status.container_statuses
               if c.state and c.state.terminated]
    assert [(r["step"], pytest.approx(r["loss"], abs=1e-5)) for r in reports if r] == [(30, last_loss)], reports
    assert final["status"]["startTime"] and final["status"]["completionTime"]
    assert final["status"]["backend"] == backend
    run = f"runs/sd15-e2e/{job_namespace}/sd15-e2e/v0"  # <checkpoints.uri>/<namespace>/<job>/v<N>
    assert final["status"]["outputUri"] == f"s3://{BUCKET}/{run}"
    assert final["status"]["latestCheckpoint"] == f"s3://{BUCKET}/{run}/checkpoint-30"
    objects = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run}/")["Contents"]}
    assert f"{run}/pytorch_lora_weights.safetensors" in objects
    assert f"{run}/checkpoint-30/manifest.json" in objects
    # The run's report lands beside its weights, and the status names it.
    assert final["status"]["reportUri"] == f"s3://{BUCKET}/{run}/report.html"
    assert f"{run}/report.html" in objects

    # The status ends true: the final step, 100% and no ETA, whatever the last poll saw.
    assert final["status"]["progress"]["step"] == 30 and final["status"]["progress"]["percent"] == 100
    assert "etaSeconds" not in final["status"]["progress"]
    table = kubectl(control_plane, "get", "tj", "sd15-e2e", "-n", job_namespace, "-o", "wide").stdout.splitlines()
    row = printed_columns(table[0], table[1])
    assert (row["PHASE"], row["STEP"], row["PROGRESS"], row["ETA"], row["BACKEND"]) == (
        "Succeeded", "30", "100", "", backend), table
    if backend == "trainjob":  # also where Kubeflow Trainer's own tools read progress
        trainer_status = get_child(api_client, backend, job_namespace, "sd15-e2e")["status"]["trainerStatus"]
        assert trainer_status["progressPercentage"] == 100

    # A user finds the run through the cluster and downloads from S3 with `kubetune checkpoints`.
    cli_env = {**os_env(), **control_plane.env()}
    listing = kubetune_cli(cli_env, "checkpoints", "ls", "sd15-e2e", "-n", job_namespace)
    assert f"s3://{BUCKET}/{run}/checkpoint-30" in listing and "<- current run" in listing, listing
    pulled = kubetune_cli(cli_env, "checkpoints", "pull", "sd15-e2e", "-n", job_namespace, "--step", "final",
                          "-o", str(tmp_path / "lora"))
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file(), pulled
    page = tmp_path / "report.html"
    kubetune_cli(cli_env, "report", "sd15-e2e", "-n", job_namespace, "--out", str(page))
    assert 'id="training-curves"' in page.read_text() and f"s3://{BUCKET}/{run}/checkpoint-30" in page.read_text()
    if backend == "trainjob":  # the generation Job is a batch Job whichever backend trained: drawn once
        generated_on_the_cluster(control_plane, api_client, core, cli_env, job_namespace, run, s3, tmp_path)
    missing = subprocess.run([sys.executable, "-m", "kubetune_cli.main", "checkpoints", "ls", "no-such-job", "-n",
                              job_namespace], env=cli_env, capture_output=True, text=True)
    assert missing.returncode == 2 and f"no TrainingJob 'no-such-job' in namespace '{job_namespace}'" in missing.stderr

    events = kubectl(control_plane, "get", "events", "-n", job_namespace,
                     "--field-selector", "involvedObject.name=sd15-e2e,involvedObject.kind=TrainingJob",
                     "-o", "json").stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"Created", "Running", "Succeeded"} <= reasons

    # The secret's value never reached the ConfigMap, the child job or the pod spec.
    secret = control_plane.env()["AWS_SECRET_ACCESS_KEY"]
    for kind in ("configmap", f"{backend_of(backend).plural}.{backend_of(backend).group}", "pod", "jobs.batch"):
        dumped = kubectl(control_plane, "get", kind, "-n", job_namespace, "-o", "yaml").stdout
        assert secret not in dumped, kind


# The Kubeflow SDK, in its own virtualenv as a user installs it (`make sdk-client`; KUBEFLOW_SDK_PYTHON overrides).
SDK_PYTHON = os.environ.get("KUBEFLOW_SDK_PYTHON") or str(REPO / ".venv-sdk" / "bin" / "python")
SDK_JOB_LOGS = """
import os, sys
from kubeflow.trainer import KubernetesBackendConfig, TrainerClient
# The kubeconfig named: the SDK takes in-cluster credentials wherever a service-account directory exists.
client = TrainerClient(KubernetesBackendConfig(namespace=sys.argv[1], config_file=os.environ["KUBECONFIG"]))
for line in client.get_job_logs(sys.argv[2]):
    print(line)
"""


def sdk_job_logs(control_plane, namespace: str, train_job: str) -> list[str]:
    """TRAIN_JOB's node-0 log as the Kubeflow SDK's TrainerClient.get_job_logs reads it."""
    read = subprocess.run([SDK_PYTHON, "-c", SDK_JOB_LOGS, namespace, train_job], capture_output=True, text=True,
                          timeout=120, env={**os_env(), "KUBECONFIG": control_plane.env()["KUBECONFIG"]})
    assert read.returncode == 0, read.stderr
    # It reads the version Trainer's chart publishes (kubeflow-trainer-public), and warns without it.
    assert "version info is not available" not in read.stderr, read.stderr
    return read.stdout.splitlines()


def generated_on_the_cluster(control_plane, api_client, core, cli_env, namespace, run, s3, tmp_path):
    """`kubetune generate --on-cluster` on the finished job: the operator's batch Job draws two images
    with the final weights into S3 beside the run, the CLI waits, prints the URI and downloads them."""
    from kubernetes import client as k8s

    from kubetune_api.contract import GENERATION_LABEL

    asked = subprocess.run([sys.executable, "-m", "kubetune_cli.main", "generate", "sd15-e2e", "-n", namespace,
                            "--on-cluster", "--prompt", "a red circle", "--prompt", "a blue square", "--steps", "2",
                            "--seed", "5", "--out", str(tmp_path / "generated"), "--timeout", "300"],
                           env=cli_env, capture_output=True, text=True, timeout=400)
    if asked.returncode != 0:  # what the operator, the Job and its pod said
        drawing = kubectl(control_plane, "get", "jobs.batch,pods", "-n", namespace, "-l", GENERATION_LABEL, "-o", "yaml",
                          check=False).stdout
        pods = core.list_namespaced_pod(namespace, label_selector=GENERATION_LABEL).items

        def log_of(pod) -> str:
            try:
                return control_plane.pod_log(pod.metadata.name, namespace, "generate").read_text()[-3000:]
            except FileNotFoundError as err:
                return str(err)

        logs = "".join(map(log_of, pods))
        pytest.fail(f"{asked.stdout}{asked.stderr}\nstatus: {get_job(api_client, namespace, 'sd15-e2e').get('status')}"
                    f"\n{drawing[-4000:]}\npod log: {logs}\noperator log:\n{operator_log(control_plane, core)}")
    printed = asked.stdout
    uri = re.search(r"generated: (s3://\S+)/", printed).group(1)
    assert uri.startswith(f"s3://{BUCKET}/{run}/generated/final-"), printed
    prefix = uri.removeprefix(f"s3://{BUCKET}/")
    objects = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]}
    assert objects == {f"{prefix}/{name}" for name in ("final-0.png", "final-1.png", "grid.png")}, objects
    for index, prompt in enumerate(("a red circle", "a blue square")):
        with Image.open(tmp_path / "generated" / f"final-{index}.png") as image:
            assert (image.text["prompt"], image.text["seed"], image.text["step"]) == (prompt, "5", "final")
    entries = get_job(api_client, namespace, "sd15-e2e")["status"]["generations"]
    assert [(e["phase"], e["uri"]) for e in entries] == [("Succeeded", uri)]
    # The Job that drew: owned by the TrainingJob, run as the trainer pod (non-root, no token).
    drawn = k8s.BatchV1Api(api_client).list_namespaced_job(namespace, label_selector=GENERATION_LABEL).items
    assert [(ref.kind, ref.name) for ref in drawn[0].metadata.owner_references] == [("TrainingJob", "sd15-e2e")]
    pod = drawn[0].spec.template.spec
    assert pod.security_context.run_as_non_root and pod.automount_service_account_token is False


def test_a_two_node_job_succeeds(control_plane, api_client, core, backend, operator_release, job_namespace,
                                 inputs_in_s3):
    manifest = example_job(inputs_in_s3, "two-nodes", "runs/two-nodes", maxSteps=2)
    manifest["spec"]["resources"]["nodes"] = 2
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    final = eventually(lambda: phase(api_client, job_namespace, "two-nodes") in ("Succeeded", "Failed")
                       and get_job(api_client, job_namespace, "two-nodes"), timeout=600, interval=2,
                       message="two-node TrainingJob finished")
    pods = job_pods(core, job_namespace, "two-nodes")
    logs = {p.metadata.name: control_plane.pod_log(p.metadata.name, job_namespace, backend_of(backend).container)
            .read_text() for p in pods}
    tails = {name: log[-2000:] for name, log in logs.items()}  # what a failure shows
    assert final["status"]["phase"] == "Succeeded", tails
    assert len(pods) == 2, f"one pod per node: {sorted(logs)}"
    # The node line is near the start of each log, not in its tail (rank 0 goes on to log its pushes).
    assert sum("node 0 of 2" in log for log in logs.values()) == 1, tails


# One backend: the CRD schema, its CEL rules and the webhook's typed model refuse these before any
# backend is looked up.
@ONLY_ON_TRAINJOB
@pytest.mark.parametrize("field,value,expected", BAD_INPUTS, ids=[f"{f}={v!r}" for f, v, _ in BAD_INPUTS])
def test_kubectl_apply_refuses_a_malformed_manifest_naming_the_field(control_plane, operator_release, field, value,
                                                                     expected):
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    result = kubectl(control_plane, "apply", "--dry-run=server", "-n", "default", "-f", "-",
                     input=yaml.safe_dump(with_change(manifest, field, value)), check=False)
    assert result.returncode != 0, f"{field}={value!r} was accepted"
    named = field.split(".")[-1] if value != "DELETE" or field != "spec.training.maxSteps" else "maxSteps"
    assert named in result.stderr, result.stderr


@ONLY_ON_TRAINJOB  # the operator's pod is the same on either backend
def test_kubectl_exec_reaches_the_operators_container_as_its_user_on_a_read_only_root(control_plane, operator_release):
    """`kubectl exec` through the API server and the kubelet's API into the operator's real container: the
    command runs as the chart's user, stdin reaches it, the root file system refuses a write and kubectl exits
    with the command's own code; with a terminal (-it, kubectl under a pseudo-terminal) a shell answers."""
    target = ["exec", "-n", OPERATOR_NAMESPACE, "deploy/kubetune", "-c", "operator", "-i", "--"]
    user = kubectl(control_plane, *target, "sh", "-c", "id -u; cat", input="from stdin\n")
    assert user.stdout == f"{NON_ROOT_UID}\nfrom stdin\n", user.stderr
    write = kubectl(control_plane, *target, "touch", "/written", check=False)
    assert write.returncode == 1 and "Read-only file system" in write.stderr, (write.returncode, write.stderr)
    controller, terminal = pty.openpty()
    shell = subprocess.Popen([*control_plane.kubectl_argv(), *target[:-1], "-t", "--", "sh"], stdin=terminal,
                             stdout=terminal, stderr=terminal, start_new_session=True)
    os.close(terminal)
    os.write(controller, b"echo in a $(tty | cut -c1-8) shell; exit 4\n")
    said, deadline = b"", time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([controller], [], [], 1)[0]:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: kubectl, the terminal's last user, is gone
                break
            said += chunk
        elif shell.poll() is not None:
            break
    os.close(controller)
    assert shell.wait(timeout=30) == 4 and b"in a /dev/pts shell" in said, said


@ONLY_ON_TRAINJOB  # the operator's pod is the same on either backend
def test_kubectl_port_forward_reaches_the_operators_metrics_port(control_plane, operator_release):
    """`kubectl port-forward` through the API server and the kubelet's API (SPDY) to the operator's container:
    two requests over two forwarded connections read its metrics page; a port nobody listens on is said so."""
    forward = subprocess.Popen([*control_plane.kubectl_argv(), "port-forward", "-n", OPERATOR_NAMESPACE,
                                "deploy/kubetune", ":metrics", ":8999"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        ports: list[int] = []
        while len(ports) < 2:  # "Forwarding from 127.0.0.1:PORT -> 9400", and the same for [::1]
            line = forward.stdout.readline()
            assert line, forward.stderr.read()
            ports += [int(found) for found in re.findall(r"127\.0\.0\.1:(\d+) ->", line)]
        for _ in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/metrics", timeout=30) as page:
                assert "kubetune_operator_" in page.read().decode()
        with pytest.raises(OSError):  # nothing listens on 8999 in the pod: the connection ends at once
            urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/", timeout=30).read()
    finally:
        forward.terminate()
        _, errors = forward.communicate(timeout=30)
    assert "error forwarding port 8999 to pod" in errors, errors


@ONLY_ON_TRAINJOB  # refused at admission, before any backend is looked up
def test_kubectl_apply_refuses_a_volume_the_namespaces_pod_security_level_forbids(control_plane, operator_release,
                                                                                core, namespace):
    """A hostPath under the `baseline` Pod Security Standard: PodSecurity admission would refuse every pod of
    the job (and its Job controller only record events), so the webhook refuses the job, naming the volume;
    the same job on a claim is admitted."""
    core.patch_namespace(namespace, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}})
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["spec"]["volumes"][0] = {"name": "data", "mountPath": "/data", "readOnly": True,
                                      "hostPath": {"path": "/mnt/datasets"}}
    refused = kubectl(control_plane, "apply", "--dry-run=server", "-n", namespace, "-f", "-",
                      input=yaml.safe_dump(manifest), check=False)
    assert refused.returncode != 0 and (
        f"spec.volumes[data].hostPath: namespace '{namespace}' enforces the 'baseline' Pod Security Standard"
        in refused.stderr), refused.stderr
    manifest["spec"]["volumes"][0] = {"name": "data", "mountPath": "/data", "readOnly": True,
                                      "persistentVolumeClaim": {"claimName": "datasets"}}
    kubectl(control_plane, "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


@ONLY_ON_PYTORCHJOB  # the pods' report is the same on either backend: one run of it is enough
def test_a_job_whose_s3_secret_does_not_exist_says_so_naming_the_field(control_plane, operator_release,
                                                                       job_namespace, inputs_in_s3, api_client):
    """The operator reads no Secret: the trainer pod's container waits (CreateContainerConfigError), and
    the job's CredentialsReady condition names spec.s3.credentialsSecret and how to fix it."""
    manifest = example_job(inputs_in_s3, "no-secret", "runs/no-secret")
    manifest["spec"]["s3"]["credentialsSecret"] = "not-there"
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def credentials_condition():
        conditions = (get_job(api_client, job_namespace, "no-secret").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "CredentialsReady" and c["status"] == "False"), None)

    condition = eventually(credentials_condition, timeout=90, message="CredentialsReady=False")
    assert condition["reason"] == "SecretNotFound"
    assert condition["message"].startswith(
        f"spec.s3.credentialsSecret: Secret 'not-there' does not exist in namespace '{job_namespace}'"), condition
    kubectl(control_plane, "delete", "tj", "no-secret", "-n", job_namespace, "--wait=false")


@ONLY_ON_TRAINJOB  # a typed-model refusal: no backend involved
def test_the_webhook_gives_the_trainers_own_message(control_plane, operator_release):
    """A rule CEL states tersely comes back in the typed model's words (the same as kubetune validate)."""
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["spec"]["model"]["pretrained"] = "s3://"
    result = kubectl(control_plane, "apply", "--dry-run=server", "-n", "default", "-f", "-",
                     input=yaml.safe_dump(manifest), check=False)
    assert result.returncode != 0
    assert "spec.model.pretrained" in result.stderr


def test_deleting_a_trainingjob_removes_everything_it_created(control_plane, api_client, core, backend,
                                                              operator_release, job_namespace, inputs_in_s3):
    manifest = example_job(inputs_in_s3, "short-lived", "runs/short-lived", maxSteps=1000)
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    eventually(lambda: job_pods(core, job_namespace, "short-lived"), timeout=120, message="trainer pod started")
    kubectl(control_plane, "delete", "tj", "short-lived", "-n", job_namespace, "--wait=true", "--timeout=120s")

    def all_gone():
        config_maps = core.list_namespaced_config_map(
            job_namespace, label_selector="kubetune.dev/trainingjob=short-lived").items
        return (not children(api_client, backend, job_namespace) and not config_maps
                and not job_pods(core, job_namespace, "short-lived"))

    eventually(all_gone, timeout=180, interval=1, message="children garbage-collected")


def test_the_operator_service_account_can_do_its_work_and_nothing_else(control_plane, backend, operator_release):
    account = f"system:serviceaccount:{OPERATOR_NAMESPACE}:kubetune"

    def can(verb, resource, namespace="default"):
        result = kubectl(control_plane, "auth", "can-i", verb, resource, "--as", account, "-n", namespace, check=False)
        return result.stdout.strip() == "yes"

    own = {"pytorchjob": [("create", "pytorchjobs.kubeflow.org"), ("patch", "pytorchjobs.kubeflow.org")],
           "trainjob": [("create", "trainjobs.trainer.kubeflow.org"), ("patch", "trainjobs.trainer.kubeflow.org"),
                        ("delete", "trainjobs.trainer.kubeflow.org"), ("patch", "trainjobs.trainer.kubeflow.org/status"),
                        ("get", "clustertrainingruntimes.trainer.kubeflow.org/kubetune-trainer")]}
    # The other backend's jobs are out of reach: RBAC follows the enabled backends.
    other = {"pytorchjob": [("create", "trainjobs.trainer.kubeflow.org"), ("list", "trainjobs.trainer.kubeflow.org")],
             "trainjob": [("create", "pytorchjobs.kubeflow.org"), ("list", "pytorchjobs.kubeflow.org"),
                          ("create", "jobsets.jobset.x-k8s.io"),
                          ("get", "clustertrainingruntimes.trainer.kubeflow.org/someone-elses")]}
    for verb, resource in [("watch", "trainingjobs.kubetune.dev"), ("patch", "trainingjobs.kubetune.dev/status"),
                           ("create", "trainingjobs.kubetune.dev"),  # a TrainingSweep's trials
                           ("watch", "trainingsweeps.kubetune.dev"), ("patch", "trainingsweeps.kubetune.dev/status"),
                           *own[backend],
                           ("create", "jobs.batch"), ("get", "jobs.batch"),  # generate --on-cluster
                           ("create", "configmaps"), ("patch", "configmaps"), ("list", "pods"), ("create", "events"),
                           ("patch", "validatingwebhookconfigurations/kubetune-trainingjobs"),
                           ("list", "workloads.kueue.x-k8s.io"),
                           ("list", "namespaces")]:  # kopf follows them; volume_policy reads a job's one's level
        assert can(verb, resource), f"the operator cannot {verb} {resource}"
    for verb, resource in [("delete", "trainingjobs.kubetune.dev"), ("create", "trainingsweeps.kubetune.dev"),
                           ("delete", "trainingsweeps.kubetune.dev"),
                           ("get", "secrets"), ("list", "secrets"), ("delete", "jobs.batch"), ("list", "jobs.batch"),
                           ("create", "pods"), ("delete", "pods"), ("delete", "pytorchjobs.kubeflow.org"),
                           *other[backend],
                           ("update", "configmaps"), ("create", "deployments.apps"), ("create", "clusterroles.rbac.authorization.k8s.io"),
                           ("patch", "validatingwebhookconfigurations/someone-elses"),
                           ("create", "validatingwebhookconfigurations"), ("create", "mutatingwebhookconfigurations"),
                           ("patch", "mutatingwebhookconfigurations/kubetune-trainingjobs"),
                           ("patch", "workloads.kueue.x-k8s.io"), ("delete", "workloads.kueue.x-k8s.io")]:
        assert not can(verb, resource), f"the operator may {verb} {resource}, which it does not need"


@ONLY_ON_PYTORCHJOB
def test_killing_the_operator_while_it_reconciles_leaves_one_child_per_job(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3):
    """20 jobs applied at once, the operator pod killed mid-way; its successor finishes the work.

    One backend: a child is never made twice because kube.create_owned creates it under its
    job's name and adopts what it owns on a conflict, whichever backend built it (the backend gives
    only the object and its API); the jobs are suspended, so no backend controller acts on them.
    """
    names = [f"burst-{i:02d}" for i in range(20)]
    documents = []
    for name in names:
        manifest = example_job(inputs_in_s3, name, f"runs/{name}")
        manifest["spec"]["suspend"] = True  # reconcile only: no trainer pods for this test
        documents.append(yaml.safe_dump(manifest))
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input="---\n".join(documents))

    eventually(lambda: len(children(api_client, backend, job_namespace)) >= 3, timeout=120, interval=0.2,
               message="reconciling started")
    kubectl(control_plane, "delete", "pod", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=kubetune-operator",
            "--grace-period=0", "--force", "--wait=false")
    eventually(lambda: len(children(api_client, backend, job_namespace)) >= len(names), timeout=300, interval=1,
               message=lambda: f"{len(children(api_client, backend, job_namespace))} of {len(names)} children; "
                               "operator log:\n" + operator_log(control_plane, core))
    time.sleep(5)  # a duplicate would show up now, if one were being made
    owners = sorted(c["metadata"]["ownerReferences"][0]["name"] for c in children(api_client, backend, job_namespace))
    assert owners == names, f"exactly one {backend_of(backend).kind} per TrainingJob"
    for name in names:
        job = get_job(api_client, job_namespace, name)
        assert (job.get("status") or {}).get("phase") == "Suspended", name


def test_suspend_maps_to_the_child_and_back(control_plane, api_client, backend, operator_release, job_namespace,
                                            inputs_in_s3):
    manifest = example_job(inputs_in_s3, "pausable", "runs/pausable")
    manifest["spec"]["suspend"] = True
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def child_suspend():
        child = get_child(api_client, backend, job_namespace, "pausable")
        return child and backend_of(backend).is_suspended(child)

    assert eventually(lambda: child_suspend() is True, timeout=60, message="child created suspended")
    assert eventually(lambda: phase(api_client, job_namespace, "pausable") == "Suspended", timeout=60,
                      message="phase Suspended")
    kubectl(control_plane, "patch", "tj", "pausable", "-n", job_namespace, "--type=merge",
            "-p", '{"spec": {"suspend": false}}')
    eventually(lambda: child_suspend() is False, timeout=60, message="child resumed")
    eventually(lambda: phase(api_client, job_namespace, "pausable") in ("Running", "Succeeded"), timeout=120,
               message="phase Running after the resume")

    # Any other change to a started job is refused, visibly, and the child keeps its spec.
    kubectl(control_plane, "patch", "tj", "pausable", "-n", job_namespace, "--type=merge",
            "-p", '{"spec": {"adapter": {"rank": 32}}}')

    def refused():
        conditions = (get_job(api_client, job_namespace, "pausable").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "SpecChangeRefused" and c["status"] == "True"), None)

    condition = eventually(refused, timeout=60, message="SpecChangeRefused condition")
    assert "spec.adapter.rank" in condition["message"]
    # So is a new size while it runs, naming the way to get it: suspend first.
    kubectl(control_plane, "patch", "tj", "pausable", "-n", job_namespace, "--type=merge",
            "-p", '{"spec": {"resources": {"nodes": 2}}}')
    condition = eventually(lambda: "suspend first" in refused()["message"] and refused(), timeout=60,
                           message="SpecChangeRefused for the size")
    assert "from 1x1 process to 2x1 processes while it runs" in condition["message"]
    child = get_child(api_client, backend, job_namespace, "pausable")
    nodes = (len(child["spec"]["pytorchReplicaSpecs"]) if backend == "pytorchjob"
             else child["spec"]["trainer"]["numNodes"])
    assert nodes == 1, child["spec"]
    kubectl(control_plane, "delete", "tj", "pausable", "-n", job_namespace, "--wait=false")


@ONLY_ON_PYTORCHJOB  # the chart's test pod reads the operator's metrics, whichever backend it runs
def test_helm_test_passes(control_plane, operator_release):
    result = subprocess.run(["helm", "test", "kubetune", "-n", OPERATOR_NAMESPACE, "--timeout", "120s"],
                            env={**os_env(), **control_plane.env()}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("backend", ["trainjob"], indirect=True)
def test_a_job_that_fails_mid_run_shows_the_last_step_it_reached_and_no_eta(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3):
    """Status that ends true on failure too: here the run outlives spec.runPolicy.activeDeadlineSeconds,
    which the backend's controller enforces by failing the job while it trains.

    TrainJob only: the Training Operator v1.9 enforced a PyTorchJob's deadline of 90 s only after
    about 5 minutes (its periodic resync, measured once), too slow and too loose for a test. The
    final status comes from the same backend-independent code (status.finished_patch, unit-tested).
    """
    manifest = example_job(inputs_in_s3, "deadline", "runs/deadline", maxSteps=100000)
    manifest["spec"]["runPolicy"] = {"activeDeadlineSeconds": 90}
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def training() -> int:
        status = get_job(api_client, job_namespace, "deadline").get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            pytest.fail(f"finished before any progress was seen: {status}\n" + operator_log(control_plane, core))
        return (status.get("progress") or {}).get("step", 0) >= 2 and status["progress"]["step"]

    seen = eventually(training, timeout=300, interval=0.5,
                      message=lambda: "progress while running; operator log:\n" + operator_log(control_plane, core))
    final = eventually(lambda: phase(api_client, job_namespace, "deadline") in ("Succeeded", "Failed")
                       and get_job(api_client, job_namespace, "deadline"), timeout=300, interval=2,
                       message=lambda: "the deadline failed the job; operator log:\n" + operator_log(control_plane, core))
    assert final["status"]["phase"] == "Failed", final["status"]
    progress = final["status"]["progress"]
    assert seen <= progress["step"] < 100000 and progress["percent"] < 100, progress
    assert "etaSeconds" not in progress, "nothing is coming: no ETA"
    table = kubectl(control_plane, "get", "tj", "deadline", "-n", job_namespace, "-o", "wide").stdout.splitlines()
    row = printed_columns(table[0], table[1])
    assert (row["PHASE"], row["STEP"], row["ETA"]) == ("Failed", str(progress["step"]), ""), table


def test_a_run_that_diverges_fails_at_once_without_a_retry_and_keeps_its_checkpoints(
        control_plane, api_client, core, backend, operator_release, job_namespace, inputs_in_s3, s3):
    """A fault in the middle of a run, on both backends: a full fine-tune at learning rate 1 with no
    clipping blows up after a few steps; the trainer exits 3, which the PyTorchJob's ExitCode policy
    and the TrainJob runtime's podFailurePolicy both treat as final (a retry would diverge again)."""
    manifest = example_job(inputs_in_s3, "diverging", "runs/diverging", maxSteps=200, optimizer="sgd",
                           learningRate=1.0, maxGradNorm=0.0, lrScheduler="constant")
    manifest["spec"]["adapter"] = {"type": "full"}
    manifest["spec"]["checkpoints"].update(everySteps=2)
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    final = eventually(lambda: phase(api_client, job_namespace, "diverging") in ("Succeeded", "Failed")
                       and get_job(api_client, job_namespace, "diverging"), timeout=600, interval=2,
                       message=lambda: "the diverged run failed; operator log:\n" + operator_log(control_plane, core))
    logs = rank0_pod_logs(control_plane, backend, job_namespace, "diverging")
    assert final["status"]["phase"] == "Failed", (final["status"], [log[-2000:] for log in logs])
    assert len(logs) == 1, "no retry: exit 3 is final"
    diverged = re.search(r"training diverged: step (\d+) gave a loss", logs[0])
    assert diverged, logs[0][-3000:]
    step = int(diverged.group(1))
    assert "etaSeconds" not in (final["status"].get("progress") or {}), "nothing is coming: no ETA"
    # The checkpoints before the fault reached the bucket whole; nothing after it was written.
    run = f"runs/diverging/{job_namespace}/diverging/v0"
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run}/").get("Contents", [])}
    complete = sorted(int(k.split("/checkpoint-")[1].split("/")[0]) for k in keys if k.endswith("/manifest.json"))
    assert complete and max(complete) < step <= max(complete) + 2, (complete, step)
    assert not any(k.startswith(f"{run}/unet/") for k in keys), "no final weights"


def test_an_enabled_embedding_cache_is_filled_before_training(control_plane, api_client, backend, operator_release,
                                                              job_namespace, inputs_in_s3, s3):
    manifest = example_job(inputs_in_s3, "cached", "runs/cached", maxSteps=2)
    manifest["spec"]["data"]["cache"] = {"enabled": True}
    manifest["spec"]["data"]["randomFlip"] = False  # every epoch then reads the same cache entries
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    final = eventually(lambda: phase(api_client, job_namespace, "cached") in ("Succeeded", "Failed")
                       and get_job(api_client, job_namespace, "cached"), timeout=600, interval=2,
                       message="cached TrainingJob finished")
    train_log = rank0_pod_logs(control_plane, backend, job_namespace, "cached")[-1]
    # PyTorchJob: the Master's init container; TrainJob: node 0's main container, before its trainers.
    stage_log = (control_plane.pod_log("cached-master-0", job_namespace, "cache").read_text()
                 if backend == "pytorchjob" else train_log)
    assert final["status"]["phase"] == "Succeeded", stage_log[-2000:] + train_log[-2000:]
    cached = s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/cached/cache/").get("KeyCount", 0)
    assert cached > 0, "the cache stage wrote entries to S3"
    assert re.search(r"embedding cache: [1-9]\d* hits", train_log), train_log[-2000:]


# ---- spec.volumes: data, models and checkpoints on PersistentVolumeClaims ---------------------------------------
# The dev cluster's storage is this machine's disk: each PersistentVolume is a hostPath, bound to its claim by
# kube-controller-manager's binder, and the process kubelet mounts it (read-only where the job says so).

# Enough steps that the pod is still training when its deletion reaches it (~7 steps a second here).
CLAIMS_JOB, CLAIMS_STEPS, CLAIMS_EVERY = "on-claims", 120, 10
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


def job_condition(api_client, namespace: str, kind: str) -> dict:
    conditions = (get_job(api_client, namespace, CLAIMS_JOB).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def claims_job_step(api_client, namespace: str) -> int:
    return ((get_job(api_client, namespace, CLAIMS_JOB).get("status") or {}).get("progress") or {}).get("step", 0)


@ONLY_ON_TRAINJOB
def test_a_job_on_two_claims_waits_for_the_missing_one_then_trains_loses_its_pod_and_resumes_from_its_claim(
        control_plane, api_client, core, backend, operator_release, namespace, tmp_path, built_images):
    """Its model and data on one PersistentVolumeClaim, its checkpoints on another (a hostPath volume each, on the
    dev cluster): it waits for the missing claim naming it, then trains, loses its pod past a checkpoint and resumes
    from the claim to the end. Its pods run as REAL CONTAINERS of our trainer image (spec.image on the registry the
    dev cluster runs as containers): UID 10001, a read-only root, every capability dropped, SIGTERM through podman."""
    inputs, runs = tmp_path / "inputs", tmp_path / "runs"
    write_tiny_model("sd15", inputs / "models" / "sd15")
    write_tiny_data("captions", inputs / "data" / "shapes", count=8, size=32)
    runs.mkdir()
    # A hostPath or NFS claim keeps its owner (fsGroup does not apply to it): its admin makes the checkpoints'
    # folder the trainer's, and the inputs readable (transformers saves weights through a temporary file: mode
    # 0600, which the trainer refuses by name: tests/images).
    os.chown(runs, NON_ROOT_UID, NON_ROOT_UID)
    for path in [inputs, *inputs.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
    written = {p: p.stat().st_mtime_ns for p in inputs.rglob("*")}
    volumes = {f"{namespace}-inputs": (inputs, "inputs"), f"{namespace}-runs": (runs, "runs")}
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["metadata"]["name"] = CLAIMS_JOB
    spec = manifest["spec"]
    spec["model"]["pretrained"] = "/inputs/models/sd15"
    spec["data"].update(uri="/inputs/data/shapes", resolution=32)
    spec["training"].update({"maxSteps": CLAIMS_STEPS, "batchSize": 2, "mixedPrecision": "no", "lrWarmupSteps": 0})
    spec["validation"] = {}
    spec["checkpoints"].update(uri="/runs", everySteps=CLAIMS_EVERY)
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec["image"] = built_images["trainer"]
    spec["volumes"] = [
        {"name": "inputs", "mountPath": "/inputs", "readOnly": True, "persistentVolumeClaim": {"claimName": "inputs"}},
        {"name": "runs", "mountPath": "/runs", "persistentVolumeClaim": {"claimName": "runs"}}]
    try:
        for volume, (path, claim) in volumes.items():
            persistent_volume(core, volume, path, namespace, claim)
        persistent_volume_claim(core, namespace, "inputs")
        kubectl(control_plane, "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))

        # The checkpoints' claim does not exist yet: the job waits, saying which volume and how to fix it.
        waiting = eventually(lambda: job_condition(api_client, namespace, "VolumesReady").get("status") == "False"
                             and job_condition(api_client, namespace, "VolumesReady"), timeout=120, interval=1,
                             message=lambda: f"VolumesReady=False; operator log:\n{operator_log(control_plane, core)}")
        assert waiting["reason"] == "ClaimNotFound"
        assert waiting["message"].startswith("spec.volumes[runs].persistentVolumeClaim.claimName: "
                                             f"PersistentVolumeClaim 'runs' does not exist in namespace '{namespace}'")
        assert phase(api_client, namespace, CLAIMS_JOB) != "Failed"

        # Once it exists and is bound, the job starts; its pod is lost past a checkpoint and the run resumes.
        persistent_volume_claim(core, namespace, "runs")
        seen = eventually(lambda: claims_job_step(api_client, namespace) >= CLAIMS_EVERY + 2 and claims_job_step(api_client, namespace),
                          timeout=300, interval=0.5, message=lambda: f"training; {operator_log(control_plane, core)}")
        core.delete_namespaced_pod(rank0_pod(core, backend, namespace, CLAIMS_JOB), namespace)
        eventually(lambda: phase(api_client, namespace, CLAIMS_JOB) in ("Succeeded", "Failed"), timeout=300, interval=2,
                   message=lambda: f"finished; operator log:\n{operator_log(control_plane, core)}")
        logs = rank0_pod_logs(control_plane, backend, namespace, CLAIMS_JOB)
        assert phase(api_client, namespace, CLAIMS_JOB) == "Succeeded", logs[-1][-3000:]
        assert job_condition(api_client, namespace, "VolumesReady")["status"] == "True"

        run = runs / namespace / CLAIMS_JOB / "v0"
        resumed = re.search(rf"resumed from {re.escape(str('/runs' / run.relative_to(runs)))}/checkpoint-(\d+) "
                            r"at step (\d+)", logs[-1])
        assert len(logs) == 2 and resumed, [log[-1500:] for log in logs]
        assert seen <= int(resumed.group(2)) < CLAIMS_STEPS, "the last checkpoint, taken on SIGTERM, on the claim"
        assert (run / "pytorch_lora_weights.safetensors").is_file(), sorted(p.name for p in run.iterdir())
        assert {p: p.stat().st_mtime_ns for p in inputs.rglob("*")} == written, "the read-only claim is as it was"
        assert {p.stat().st_uid for p in run.rglob("*")} == {NON_ROOT_UID}, "written by the container's user"
    finally:
        kubectl(control_plane, "delete", "tj", CLAIMS_JOB, "-n", namespace, "--ignore-not-found", "--wait=true")
        for volume in volumes:
            core.delete_persistent_volume(volume)
