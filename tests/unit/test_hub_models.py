"""Hub models in the pods the operator renders and in the entry point: the token reaches only the
process that downloads, as a Secret reference; the mirror and the hub's address come from the chart."""
import copy
import sys

import pytest
import yaml

from kubetune_api import contract
from kubetune_api.hub import hub_inputs
from kubetune_api.manifest import parse_manifest
from kubetune_operator.backends import PyTorchJobBackend, TrainJobBackend
from kubetune_operator.settings import Settings
from kubetune_operator.trainer_config import build_config_map

UID = "0d7f7c1e-5a55-4a4e-9a1b-2a7b0f3c9e11"
SETTINGS = Settings(models_mirror_uri="s3://models/mirror", hub_endpoint="http://hub.internal:8080",
                    backends=("pytorchjob", "trainjob"))
TOKEN_REF = {"name": contract.HUB_TOKEN_ENV,
             "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}


@pytest.fixture
def hub_job(example_manifest):
    def make(cache: bool = False, **model):
        manifest = copy.deepcopy(example_manifest)
        manifest["spec"]["model"].update({"pretrained": "black-forest-labs/FLUX.1-dev-standin", "revision": "v1.0",
                                          "hubTokenSecret": "hf-token", **model})
        manifest["spec"]["data"]["cache"] = {"enabled": cache}
        return parse_manifest(manifest)
    return make


def pod_of(child):
    return child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def env_names(container) -> dict:
    return {entry["name"]: entry for entry in container["env"]}


def test_the_hub_token_reaches_the_pod_only_as_a_secret_reference(hub_job):
    job = hub_job()
    main = pod_of(PyTorchJobBackend().build(job, UID, SETTINGS))["containers"][0]
    assert env_names(main)[contract.HUB_TOKEN_ENV] == TOKEN_REF
    assert "HF_TOKEN" not in env_names(main), "no library in the trainers picks a token up by its usual name"
    config = build_config_map(job)["data"]["trainingjob.yaml"]
    assert yaml.safe_load(config)["spec"]["model"]["hubTokenSecret"] == "hf-token" and "valueFrom" not in config


def test_with_the_cache_the_models_stage_runs_first_and_only_it_gets_the_token(hub_job):
    pod = pod_of(PyTorchJobBackend().build(hub_job(cache=True), UID, SETTINGS))
    models, cache = pod["initContainers"]
    assert models["name"] == "models" and models["command"] + models["args"] == [
        *contract.MODELS_STAGE_COMMAND, *contract.MODELS_STAGE_ARGS]
    assert env_names(models)[contract.HUB_TOKEN_ENV] == TOKEN_REF
    assert cache["name"] == "cache" and contract.HUB_TOKEN_ENV not in env_names(cache)


def test_a_job_without_hub_models_gets_no_models_stage(hub_job):
    pod = pod_of(PyTorchJobBackend().build(hub_job(cache=True, pretrained="s3://models/sd15", revision=None), UID, SETTINGS))
    assert [c["name"] for c in pod["initContainers"]] == ["cache"]


def test_the_charts_mirror_and_hub_endpoint_reach_both_backends(hub_job):
    job = hub_job()
    pytorch_env = env_names(pod_of(PyTorchJobBackend().build(job, UID, SETTINGS))["containers"][0])
    trainjob_env = {e["name"]: e for e in TrainJobBackend().build(job, UID, SETTINGS)["spec"]["trainer"]["env"]}
    for env in (pytorch_env, trainjob_env):
        assert env[contract.MODELS_MIRROR_ENV]["value"] == "s3://models/mirror"
        assert env["HF_ENDPOINT"]["value"] == "http://hub.internal:8080"
        assert env[contract.HUB_TOKEN_ENV] == TOKEN_REF


@pytest.mark.parametrize("model, validation, fields", [
    ({"pretrained": "org/name"}, {}, ["spec.model.pretrained"]),
    ({"pretrained": "s3://bkt/m", "vae": "madebyollin/sdxl-vae-fp16-fix"}, {"clipModel": "openai/clip-vit-base-patch32"},
     ["spec.model.vae", "spec.validation.clipModel"]),
    ({"pretrained": "/models/sd15", "vae": "./vae"}, {"clipModel": "s3://bkt/clip"}, []),
])
def test_which_inputs_are_hub_models(example_manifest, model, validation, fields):
    manifest = copy.deepcopy(example_manifest)
    manifest["spec"]["model"].update(model)
    if validation:
        manifest["spec"]["validation"] = {"prompts": ["a red square"], **validation}
    assert [item.field for item in hub_inputs(parse_manifest(manifest).spec)] == fields


def test_the_entry_point_gives_the_token_to_the_models_stage_and_to_no_trainer(hub_job, tmp_path, monkeypatch):
    from kubetune_trainer import pod

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(hub_job().model_dump(mode="json", by_alias=True, exclude_none=True)))
    monkeypatch.setenv(contract.HUB_TOKEN_ENV, "hf_secret")
    seen = {}

    def run(command, env):
        seen.update(command=command, token=env.get(contract.HUB_TOKEN_ENV))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(pod.subprocess, "run", run)
    assert pod.models_stage(config) == 0
    assert seen == {"command": [sys.executable, "-m", "kubetune_trainer.models.hub_stage", "--config", str(config)],
                    "token": "hf_secret"}
    import os
    assert contract.HUB_TOKEN_ENV not in os.environ, "the trainers started after it inherit no token"
