"""`kubetune generate --on-cluster` in the operator: the request the CLI writes, the batch Job rendered
from the trainer's pod template, and the status entry read back from the Job (pure functions)."""
import copy

import pytest

from kubetune_api.contract import GENERATE_ANNOTATION, GENERATION_COMMAND, GENERATION_LABEL
from kubetune_api.generation_request import BadGenerationRequest, GenerationRequest
from kubetune_api.manifest import parse_manifest
from kubetune_api.spec_status import Generation
from kubetune_operator.generation_jobs import (generation_status, job_name, merged_entries, pending,
                                               render_generation_job)
from kubetune_operator.pod_template import ContainerShape, pod_template
from kubetune_operator.settings import Settings

SETTINGS = Settings(trainer_image="registry.example/kubetune/trainer:1.2", s3_endpoint_url="http://s3.local:9000",
                    default_cpu_per_process="2", default_memory_per_process="8Gi")
UID = "0d7f7c1e-5a55-4a4e-9a1b-2a7b0f3c9e11"
RUN = "s3://bucket/runs/team-a/sd15/v3"


@pytest.fixture
def job_of(example_manifest):
    def make(gpus: int = 1, processes: int | None = None, queue: str | None = None):
        manifest = copy.deepcopy(example_manifest)
        manifest["metadata"]["namespace"] = "team-a"
        manifest["spec"]["resources"] = {"nodes": 2, "gpusPerNode": gpus}
        manifest["spec"]["s3"] = {"credentialsSecret": "s3-credentials"}
        if processes:
            manifest["spec"]["distributed"] = {"processesPerNode": processes}
        if queue:
            manifest["spec"].setdefault("scheduling", {})["queueName"] = queue
        return parse_manifest(manifest)
    return make


def request(**changes) -> GenerationRequest:
    return GenerationRequest(**{"id": "abc123", "run": RUN, "step": "4", "prompts": ("a red circle", "a blue one"),
                                "steps": 20, "seed": 7, **changes})


def test_a_request_survives_its_annotation_and_names_its_folder_beside_the_run():
    asked = request(compare=True)
    assert GenerationRequest.from_annotation(asked.to_annotation()) == asked
    assert asked.label == "step-4-compare-abc123"
    assert asked.out == f"{RUN}/generated/step-4-compare-abc123"
    assert request(step="final").out.endswith("/generated/final-abc123")
    assert asked.args() == ["--run", RUN, "--step", "4", "--out", asked.out, "--compare", "--prompt", "a red circle",
                            "--prompt", "a blue one", "--steps", "20", "--seed", "7"]


@pytest.mark.parametrize("text,message", [
    ("{not json", "not a generation request"),
    ('["a list"]', "not a generation request"),
    ('{"id": "abc", "run": "s3://b/r"}', "not a generation request"),  # no step
    ('{"id": "ABC/..", "run": "s3://b/r", "step": "final"}', "id 'ABC/..'"),
    ('{"id": "abc", "run": "s3://b/r", "step": "latest"}', "step 'latest'"),
    ('{"id": "abc", "run": "s3://b/r", "step": "base", "compare": true}', "compare draws the base already"),
    ('{"id": "abc", "run": "s3://b/r", "step": "final", "shell": "rm -rf /"}', "not a generation request"),
])
def test_an_annotation_the_operator_cannot_act_on_is_refused_in_one_line(text, message):
    with pytest.raises(BadGenerationRequest, match=message.replace("(", r"\(").replace(".", r"\.")) as caught:
        GenerationRequest.from_annotation(text)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("run,out,problem", [
    (RUN, None, None),
    ("s3://bucket/runs/team-b/sd15/v3", None, "is not a run of this job"),
    ("s3://bucket/runs/team-a/sd15/../../team-b/x/v0", None, "is not a run of this job"),
    (RUN, "s3://bucket/elsewhere", "is not beside the run"),
])
def test_a_request_draws_from_and_writes_beside_the_jobs_own_runs_only(run, out, problem):
    found = request(run=run, **({"out": out} if out else {})).belongs_to("s3://bucket/runs/team-a/sd15")
    assert (found is None) if problem is None else (problem in found)


def test_the_generation_job_runs_the_trainer_pod_with_the_generation_command(job_of):
    job = job_of(gpus=8)
    asked = request()
    rendered = render_generation_job(job, UID, SETTINGS, asked)
    trainer = pod_template(job, UID, SETTINGS, ContainerShape("generate"), serves_metrics=False)
    pod = rendered["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert rendered["apiVersion"] == "batch/v1" and rendered["kind"] == "Job"
    assert rendered["metadata"]["name"] == job_name(job.metadata.name, "abc123") == f"{job.metadata.name}-generate-abc123"
    assert GenerationRequest.from_annotation(rendered["metadata"]["annotations"][GENERATE_ANNOTATION]) == asked
    # The trainer's own image, environment (credentials by reference), security context and volumes.
    for key in ("image", "env", "securityContext", "volumeMounts"):
        assert container[key] == trainer["spec"]["containers"][0][key], key
    assert pod["spec"]["securityContext"] == trainer["spec"]["securityContext"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert {"name": "AWS_SECRET_ACCESS_KEY",
            "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": "AWS_SECRET_ACCESS_KEY"}}} in container["env"]
    assert container["command"] == list(GENERATION_COMMAND) and container["args"] == asked.args()
    assert "ports" not in container
    # One process: one GPU of the job's eight, and one process's default CPU and memory.
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "1", "cpu": "2", "memory": "8Gi"},
                                      "limits": {"nvidia.com/gpu": "1"}}
    assert pod["spec"]["restartPolicy"] == "Never" and rendered["spec"]["backoffLimit"] == 0
    assert pod["metadata"]["labels"][GENERATION_LABEL] == "abc123"
    assert "annotations" not in pod["metadata"], "no scrape target: the pod serves no metrics"


def test_a_cpu_job_draws_on_one_cpu_process_and_a_queued_job_is_not_queued_for_it(job_of):
    container_of = lambda job: render_generation_job(job, UID, SETTINGS, request())["spec"]["template"]  # noqa: E731
    cpu = container_of(job_of(gpus=0, processes=4))
    assert cpu["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}}
    queued = render_generation_job(job_of(queue="team-a-queue"), UID, SETTINGS, request())
    assert not any(key.startswith("kueue.x-k8s.io") for key in queued["metadata"]["labels"])
    assert not any(key.startswith("kueue.x-k8s.io") for key in queued["spec"]["template"]["metadata"]["labels"])


def generation_job(*conditions: dict, **status) -> dict:
    return {"metadata": {"name": "sd15-lora-demo-generate-abc123", "namespace": "team-a",
                         "annotations": {GENERATE_ANNOTATION: request().to_annotation()}},
            "status": {"conditions": list(conditions), **status}}


@pytest.mark.parametrize("job_obj,expected", [
    (generation_job(), {"phase": "Running"}),
    (generation_job(startTime="2026-11-27T10:00:00Z"), {"phase": "Running", "startTime": "2026-11-27T10:00:00Z"}),
    (generation_job({"type": "Complete", "status": "True"}, startTime="2026-11-27T10:00:00Z",
                    completionTime="2026-11-27T10:02:00Z"),
     {"phase": "Succeeded", "startTime": "2026-11-27T10:00:00Z", "completionTime": "2026-11-27T10:02:00Z"}),
    (generation_job({"type": "Complete", "status": "False"}), {"phase": "Running"}),
    (generation_job({"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                     "message": "Job has reached the specified backoff limit"}),
     {"phase": "Failed", "message": "BackoffLimitExceeded: Job has reached the specified backoff limit "
                                    "(kubectl logs -n team-a job/sd15-lora-demo-generate-abc123)"}),
])
def test_the_status_entry_follows_the_jobs_conditions(job_obj, expected):
    entry = generation_status(job_obj)
    assert entry == {"id": "abc123", "uri": request().out, "job": "sd15-lora-demo-generate-abc123", **expected}
    # The CRD's status schema (from this model) keeps every field: the API server prunes unknown ones.
    assert Generation.model_validate(entry).model_dump(by_alias=True, exclude_none=True) == entry


def test_status_keeps_one_entry_per_request_and_the_latest_ten():
    entries = [{"id": f"r{i}", "phase": "Succeeded"} for i in range(10)]
    updated = merged_entries(entries, {"id": "r3", "phase": "Failed"})
    assert len(updated) == 10 and updated[-1] == {"id": "r3", "phase": "Failed"}
    assert [e["id"] for e in merged_entries(entries, {"id": "new", "phase": "Running"})][0] == "r1"


@pytest.mark.parametrize("annotation,entries,expected", [
    (None, [], False),
    (request().to_annotation(), [], True),
    (request().to_annotation(), [{"id": "abc123", "phase": "Running"}], True),
    (request().to_annotation(), [{"id": "abc123", "phase": "Succeeded"}], False),
    (request().to_annotation(), [{"id": "older", "phase": "Succeeded"}], True),
    ("{broken", [], True),  # answered once, as Failed
    ("{broken", [{"id": "invalid", "phase": "Failed"}], False),
    ('{"id": "abc", "step": "latest"}', [{"id": "abc", "phase": "Failed"}], False),  # under its own id
])
def test_the_operator_follows_a_request_until_it_is_answered(annotation, entries, expected):
    annotations = {GENERATE_ANNOTATION: annotation} if annotation else {}
    assert pending(annotations, {"generations": entries}) is expected


@pytest.mark.parametrize("args,message", [
    (["s3://bucket/runs/team-a/sd15"], "--on-cluster: JOB 's3://bucket/runs/team-a/sd15' is a URI; give the TrainingJob's name"),
    (["sd15", "--control", "cat.png", "--prompt", "x"], "--on-cluster: --control images are files on this machine"),
    (["sd15", "--device", "cuda"], "--on-cluster: --device is for drawing here"),
    (["sd15", "--no-wait", "--out", "images"], "--on-cluster: --out with --no-wait"),
])
def test_generate_on_cluster_refuses_what_the_pod_cannot_take_before_asking_anything(args, message, tmp_path,
                                                                                     monkeypatch):
    from click.testing import CliRunner

    from kubetune_cli.main import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-cluster"))
    result = CliRunner().invoke(cli, ["generate", "--on-cluster", *args])
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1, result.output
    assert list(tmp_path.iterdir()) == [], "nothing written"
