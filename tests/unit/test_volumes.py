"""spec.volumes: the mounts a job's pods get, and on a cluster, every local path under one of them.

The volume rules (kubetune_api.volumes) are the typed model's, and test_rules compares their CEL with
their Python; the cluster's rules (kubetune_api.cluster_paths) are the CRD's and the webhook's only,
compared here the same way on jobs that keep and break each.
"""
from __future__ import annotations

import copy

import kopf
import pytest
import yaml

from kubetune_api.cluster_paths import CLUSTER_RULES, PATH_FIELDS, refusals
from kubetune_api.crd import build_crd, build_sweep_crd
from kubetune_api.manifest import ManifestError, parse_manifest
from kubetune_api.rules import SKIP_RULES
from kubetune_api.spec import TrainingJobSpec
from kubetune_operator import handlers
from kubetune_operator.backends import PyTorchJobBackend, TrainJobBackend
from kubetune_operator.settings import Settings
from tests.conftest import REPO
from tests.unit.test_operator_handlers import api, job_body  # noqa: F401  (fixtures and the body the webhook gets)
from tests.unit.test_rules import cel_holds

SETTINGS = Settings(trainer_image="registry.example/kubetune/trainer:1.2", backend="trainjob",
                    backends=("trainjob", "pytorchjob"))
DATA = {"name": "data", "mountPath": "/data", "readOnly": True, "persistentVolumeClaim": {"claimName": "datasets"}}
CHECKPOINTS = {"name": "checkpoints", "mountPath": "/checkpoints", "persistentVolumeClaim": {"claimName": "ck"}}
MODELS = {"name": "models", "mountPath": "/models", "readOnly": True, "nfs": {"server": "nfs.internal", "path": "/m"}}

def spec_with(example: dict, volumes: list[dict] | None = None, **paths) -> TrainingJobSpec:
    """The example's spec with VOLUMES and each dotted path field (a__b = spec.a.b) set."""
    spec = copy.deepcopy(example["spec"])
    spec["volumes"] = [DATA, CHECKPOINTS] if volumes is None else volumes
    for dotted, value in paths.items():
        *parents, last = dotted.split("__")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return TrainingJobSpec.model_validate(spec, context={SKIP_RULES: True})


JOBS = [
    {},                                                            # the example: /data and /checkpoints mounted
    {"volumes": []},                                               # nothing mounted: both refused
    {"volumes": [DATA]},                                           # checkpoints not mounted
    {"volumes": [DATA, {**CHECKPOINTS, "readOnly": True}]},        # checkpoints on a read-only mount
    {"data__uri": "/data"},                                        # the mount itself
    {"data__uri": "/database/pets"},                               # a sibling of /data, not under it
    {"data__uri": "/data/../etc"},                                 # climbs out of its mount
    {"data__uri": "data/pets"},                                    # relative: a hub-like id, not a path
    {"data__uri": "./pets"},                                       # relative: nothing in a pod
    {"data__uri": "s3://bucket/pets", "checkpoints__uri": "s3://bucket/runs", "volumes": []},
    {"model__pretrained": "/models/sd15"},                         # not mounted
    {"model__pretrained": "/models/sd15", "volumes": [DATA, CHECKPOINTS, MODELS]},
    {"model__vae": "/data/vae"},
    {"model__vae": "/elsewhere/vae"},
    {"data__cache": {"enabled": True, "uri": "/data/cache"}},      # the cache is written: not on read-only /data
    {"data__cache": {"enabled": True, "uri": "/checkpoints/cache"}},
    {"validation__clipModel": "/models/clip", "volumes": [DATA, CHECKPOINTS, MODELS]},
    {"validation__clipModel": "/nowhere/clip"},
    {"adapter__initFrom": "/checkpoints/previous"},
    {"adapter__initFrom": "/tmp/previous"},
]


@pytest.fixture
def jobs(example_manifest) -> list[TrainingJobSpec]:
    return [spec_with(example_manifest, **changes) for changes in JOBS]


def test_every_path_field_of_the_spec_is_found_by_its_type():
    assert {field.name for field in PATH_FIELDS} >= {
        "spec.model.pretrained", "spec.model.vae", "spec.model.mirrorUri", "spec.adapter.initFrom", "spec.data.uri",
        "spec.data.cache.uri", "spec.checkpoints.uri", "spec.validation.clipModel", "spec.pmg.languageModel"}


def test_every_cluster_rules_cel_agrees_with_its_python_and_each_is_kept_and_broken(jobs):
    seen = {}
    for spec in jobs:
        document = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
        for rule in CLUSTER_RULES:
            python = rule.holds(spec)
            assert cel_holds(rule.cel, document) == python, (rule.message, document)
            seen.setdefault(rule.message, set()).add(python)
    # pmg.languageModel needs the pmg family and model.mirrorUri is an s3:// prefix by its own rule: their
    # cluster rules are the same function as the others'.
    never_broken = [m for m, outcomes in seen.items() if outcomes != {True, False}
                    and not m.startswith(("spec.pmg.languageModel", "spec.model.mirrorUri"))]
    assert not never_broken, never_broken


@pytest.mark.parametrize("changes,refused", [
    ({}, []),
    ({"volumes": []}, ["spec.data.uri", "spec.checkpoints.uri"]),
    ({"volumes": [DATA, {**CHECKPOINTS, "readOnly": True}]}, ["spec.checkpoints.uri"]),
    ({"data__uri": "/data/../etc"}, ["spec.data.uri"]),
    ({"data__cache": {"enabled": True, "uri": "/data/cache"}}, ["spec.data.cache.uri"]),
    ({"model__pretrained": "stable-diffusion-v1-5/stable-diffusion-v1-5"}, []),  # a hub id, not a path
])
def test_a_cluster_refuses_each_unmounted_path_naming_the_field_and_the_fix(example_manifest, changes, refused):
    messages = refusals(spec_with(example_manifest, **changes))
    assert [m.split(":")[0] for m in messages] == refused
    assert all("mount the volume that holds it" in m and "or use an s3:// URI" in m for m in messages)


def test_a_workstation_takes_the_same_local_paths_without_volumes(example_manifest):
    manifest = copy.deepcopy(example_manifest)
    manifest["spec"].pop("volumes")
    assert parse_manifest(manifest).spec.data.uri == "/data/pets"


@pytest.mark.parametrize("path", sorted((REPO / "manifests" / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_applies_on_a_cluster_as_written(path):
    """Its "On a cluster" line: every local path of the example lies under one of its volumes."""
    assert refusals(parse_manifest(yaml.safe_load(path.read_text())).spec) == []


def test_the_crds_carry_the_cluster_rules_for_jobs_and_sweep_templates():
    job = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    template = (build_sweep_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
                ["properties"]["template"]["properties"]["spec"])
    for schema in (job, template):
        messages = [v["message"] for v in schema["x-kubernetes-validations"]]
        assert all(rule.message in messages for rule in CLUSTER_RULES)


def test_the_webhook_refuses_an_unmounted_path_in_the_typed_models_words(api, example_manifest):  # noqa: F811
    with pytest.raises(kopf.AdmissionError, match=r"^spec.data.uri: on a cluster a local path must be absolute"):
        handlers.validate_new_job(body=job_body(example_manifest, volumes=[CHECKPOINTS]), warnings=[])
    handlers.validate_new_job(body=job_body(example_manifest), warnings=[])


@pytest.mark.parametrize("volumes,message", [
    ([{"name": "data", "mountPath": "/data"}], "each volume takes exactly one source"),
    ([{**DATA, "nfs": {"server": "s", "path": "/x"}}], "each volume takes exactly one source"),
    ([{**DATA, "mountPath": "/tmp"}], "nor on, under or over where the trainer keeps"),
    ([{**DATA, "mountPath": "/var"}], "nor on, under or over where the trainer keeps"),
    ([{**DATA, "mountPath": "/dev/shm/x"}], "nor on, under or over where the trainer keeps"),
    ([{**DATA, "mountPath": "/"}], "a mountPath may not be /"),
    ([{**DATA, "mountPath": "/data/../x"}], "no '.' or '..' segment"),
    ([DATA, {**CHECKPOINTS, "name": "data"}], "each volume's name is used once"),
    ([DATA, {**CHECKPOINTS, "mountPath": "/data"}], "each mountPath is used once"),
    ([{**DATA, "mountPath": "data"}], "mountPath"),  # not absolute: the schema's pattern
])
def test_a_bad_volume_is_refused_anywhere_naming_it(example_manifest, volumes, message):
    manifest = copy.deepcopy(example_manifest)
    manifest["spec"]["volumes"] = volumes
    with pytest.raises(ManifestError, match="spec.volumes") as caught:
        parse_manifest(manifest)
    assert message in str(caught.value)


@pytest.mark.parametrize("backend", [PyTorchJobBackend(), TrainJobBackend()], ids=lambda b: b.name)
def test_every_pod_of_the_job_mounts_its_volumes(example_manifest, backend):
    manifest = copy.deepcopy(example_manifest)
    manifest["metadata"]["namespace"] = "team-a"
    manifest["spec"]["volumes"] = [DATA, CHECKPOINTS, MODELS]
    manifest["spec"]["model"]["pretrained"] = "/models/sd15"
    pods = list(pod_specs(backend.build(parse_manifest(manifest), "uid-1", SETTINGS)))
    assert pods, "the child carries pod specs (PyTorchJob: each replica's; TrainJob: its runtime patch)"
    for pod in pods:
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}} in pod["volumes"]
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ck"}} in pod["volumes"]
        assert {"name": "models", "nfs": {"server": "nfs.internal", "path": "/m", "readOnly": True}} in pod["volumes"]
        for container in pod["containers"] + pod.get("initContainers", []):
            assert [m for m in container["volumeMounts"] if m["name"] in ("data", "checkpoints", "models")] == [
                {"name": "data", "mountPath": "/data", "readOnly": True},
                {"name": "checkpoints", "mountPath": "/checkpoints"},
                {"name": "models", "mountPath": "/models", "readOnly": True}], container["name"]


def pod_specs(node):
    """Every pod spec (a dict with volumes and containers) in a rendered child."""
    if isinstance(node, dict):
        if "volumes" in node and "containers" in node:
            yield node
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for item in node:
            yield from pod_specs(item)
