"""Each cross-field rule is written once (kubetune_api.rules.Rule): its CEL, which the API server
runs, must say what its Python side says. Both are evaluated here on the same jobs — the example,
and variations that break each rule or just keep it — the CEL with a CEL interpreter (cel-python)
on the job as the API server sees it after defaulting, the Python on the typed job."""
from __future__ import annotations

import copy
import functools

import celpy
import pytest
import yaml

from kubetune_api.rules import SKIP_RULES
from kubetune_api.spec_data import DATA_RULES
from kubetune_api.spec_resources import DISTRIBUTED_RULES, SCHEDULING_RULES
from kubetune_api.spec import JOB_RULES, TrainingJobSpec
from kubetune_api.spec_model import MODEL_RULES
from kubetune_api.spec_training import PMG_RULES, TRAINING_RULES
from kubetune_api.families import FAMILIES, FAMILY_NAMES, OPTIONS
from tests.conftest import REPO
from tests.family_options import SETTINGS, with_family

# Where each list of rules sits in the spec (its CEL's `self`).
LEVELS = [(JOB_RULES, None), (TRAINING_RULES, "training"), (DISTRIBUTED_RULES, "distributed"),
          (SCHEDULING_RULES, "scheduling"), (PMG_RULES, "pmg"), (DATA_RULES, "data"), (MODEL_RULES, "model")]

_PVC = {"persistentVolumeClaim": {"claimName": "datasets"}}
VARIATIONS = [
    {},
    # spec.volumes, one job breaking each of its rules (the example keeps them): a volume without a source,
    # one with two, one over /tmp, one with a '..' segment, a name and a mountPath used twice.
    {"spec.volumes": [{"name": "a", "mountPath": "/a"},
                      {"name": "b", "mountPath": "/b", **_PVC, "nfs": {"server": "s", "path": "/x"}},
                      {"name": "c", "mountPath": "/tmp", **_PVC}, {"name": "d", "mountPath": "/d/../e", **_PVC},
                      {"name": "a", "mountPath": "/b", **_PVC}]},
    {"spec.model.revision": "v1.0"},
    {"spec.model.revision": "main", "spec.model.pretrained": "s3://models/sd15"},
    {"spec.model.revision": "main", "spec.model.pretrained": "./models/sd15"},
    {"spec.training.epochs": 3},
    {"spec.training.maxSteps": "DELETE"},
    {"spec.training.maxSteps": "DELETE", "spec.training.epochs": 2},
    {"spec.training.optimizer": "schedulefree-adamw", "spec.training.lrScheduler": "cosine"},
    {"spec.training.optimizer": "schedulefree-adamw", "spec.training.lrScheduler": "constant"},
    {"spec.distributed.cpuOffload": True},
    {"spec.distributed.cpuOffload": True, "spec.distributed.strategy": "fsdp"},
    {"spec.scheduling.workloadPriorityClass": "high"},
    {"spec.scheduling.workloadPriorityClass": "high", "spec.scheduling.queueName": "training"},
    {"spec.data.layout": "edit-pairs"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.data.controlDropout": 0.1},
    {"spec.pmg": {}},
    {"spec.model.family": "pmg", "spec.data.layout": "pmg", "spec.pmg": {"prefixHiddenSize": 512}},
    {"spec.model.family": "pmg", "spec.data.layout": "pmg",
     "spec.pmg": {"prefixHiddenSize": 512, "prefixProjection": True}},
    {"spec.data.controlDropout": 0.1},
    {"spec.validation.monitor": "accuracy"},
    {"spec.validation.monitor": "f1"},
    {"spec.model.family": "classifier", "spec.data.layout": "image-folder", "spec.validation.monitor": "f1"},
    {"spec.validation.monitor": "precision"},
    {"spec.model.family": "classifier", "spec.data.layout": "image-folder", "spec.validation.monitor": "precision"},
    {"spec.validation.monitor": "recall"},
    {"spec.model.family": "classifier", "spec.data.layout": "image-folder", "spec.validation.monitor": "recall"},
    {"spec.validation.monitor": "clip_score"},
    {"spec.validation.monitor": "clip_score", "spec.validation.clipModel": "/models/clip"},
    {"spec.validation.monitor": "clip_directional", "spec.validation.clipModel": "/models/clip"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.validation.monitor": "clip_directional"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.validation.monitor": "clip_score",
     "spec.validation.clipModel": "/models/clip"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.validation.monitor": "clip_directional",
     "spec.validation.clipModel": "s3://models/clip"},
    {"spec.distributed.processesPerNode": 2},
    {"spec.distributed.processesPerNode": 2, "spec.resources.gpusPerNode": 0},
    {"spec.distributed.processesPerNode": 4, "spec.resources.gpusPerNode": 4},
    {"spec.model.quantization": "nf4", "spec.adapter.type": "full"},
    {"spec.model.quantization": "nf4"},
    {"spec.distributed.strategy": "fsdp", "spec.model.quantization": "fp8"},
    {"spec.distributed.strategy": "fsdp", "spec.training.optimizer": "adamw8bit"},
    {"spec.distributed.strategy": "fsdp", "spec.training.mixedPrecision": "fp16"},
    {"spec.distributed.strategy": "fsdp", "spec.training.mixedPrecision": "bf16"},
    {"spec.resources.gpusPerNode": 0, "spec.model.quantization": "fp8"},
    {"spec.resources.gpusPerNode": 0, "spec.model.quantization": "nf4"},
    {"spec.resources.gpusPerNode": 0, "spec.training.optimizer": "adamw8bit"},
    {"spec.resources.gpusPerNode": 0, "spec.training.mixedPrecision": "fp16"},
    {"spec.resources.gpusPerNode": 0, "spec.distributed.cpuOffload": True, "spec.distributed.strategy": "fsdp"},
    {"spec.resources.gpusPerNode": 2, "spec.training.mixedPrecision": "fp16", "spec.training.optimizer": "adamw8bit"},
    {"spec.training.compileMode": "max-autotune-no-cudagraphs"},
    {"spec.training.compileMode": "reduce-overhead", "spec.training.compile": True},
    {"spec.resources.gpusPerNode": 0, "spec.training.compileMode": "reduce-overhead", "spec.training.compile": True},
    {"spec.resources.gpusPerNode": 0, "spec.training.compile": True},
    {"spec.training.attention": "flash3"},
    {"spec.resources.gpusPerNode": 0, "spec.training.attention": "flash3"},
    {"spec.model.encoderDevice": "cpu"},
    {"spec.model.encoderDevice": "gpu"},
    {"spec.resources.gpusPerNode": 0, "spec.model.encoderDevice": "gpu"},
    {"spec.data.imageColumn": "image", "spec.data.captionColumn": "prompt"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.data.captionColumn": "prompt"},
    {"spec.data.format": "parquet", "spec.data.imageColumn": "picture", "spec.data.captionColumn": "prompt"},
    {"spec.data.format": "webdataset", "spec.data.labelColumn": "label"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.data.format": "webdataset"},
    {"spec.model.family": "pmg", "spec.data.layout": "pmg", "spec.data.format": "parquet"},
    {"spec.model.family": "classifier", "spec.data.layout": "image-folder", "spec.data.imageColumn": "img"},
    {"spec.model.family": "classifier", "spec.data.layout": "image-folder", "spec.data.format": "parquet",
     "spec.data.imageColumn": "img", "spec.data.labelColumn": "fine_label"},
    {"spec.model.family": "classifier", "spec.data.layout": "image-folder", "spec.data.labelColumn": "fine_label"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.data.format": "parquet",
     "spec.data.controlColumn": "input_image", "spec.data.imageColumn": "edited_image",
     "spec.data.captionColumn": "edit_prompt"},
    {"spec.model.family": "flux-kontext", "spec.data.layout": "edit-pairs", "spec.data.controlColumn": "input_image"},
    {"spec.data.format": "webdataset", "spec.data.controlColumn": "control"},
] + [
    # Every family whose patches need a coarser resolution: one it refuses, one it takes.
    {**with_family(family), "spec.data.resolution": FAMILIES[family].resolution_multiple * k + 8 * (k % 2)}
    for family in FAMILY_NAMES if FAMILIES[family].resolution_multiple > 8 for k in (63, 64)
] + [
    {"spec.data.resolution": [832, 576]},
    {"spec.data.resolution": [832]},
    {"spec.data.resolution": [832, 570]},
    {"spec.data.resolution": 1004},
    {**with_family("z-image"), "spec.data.resolution": [832, 584]},
] + [
    # Video clips: frames needed by the video layout and refused elsewhere, its forms, fps, s3:// clips.
    {"spec.data.frames": 5},
    {"spec.data.fps": 8.0},
    {"spec.data.layout": "video-captions"},
    {"spec.data.layout": "video-captions", "spec.data.frames": [5, 5]},
    {"spec.data.layout": "video-captions", "spec.data.frames": [33, 81], "spec.data.fps": 16.0,
     "spec.data.captionColumn": "prompt"},
    {"spec.data.layout": "video-captions", "spec.data.frames": 0},
    {"spec.data.layout": "video-captions", "spec.data.frames": 5, "spec.data.uri": "s3://data/clips"},
    {"spec.data.layout": "video-captions", "spec.data.frames": 5, "spec.data.uri": "s3://data/clips",
     "spec.data.streaming": {"enabled": False}},
] + [
    # Every family whose model takes only some frame counts: one count it refuses, one it takes.
    {**with_family(family), "spec.data.layout": "video-captions", "spec.data.frames": frames}
    for family in FAMILY_NAMES if FAMILIES[family].frame_rule.multiple > 1
    for frames in (FAMILIES[family].frame_rule.nearest(80)[0], FAMILIES[family].frame_rule.nearest(80)[0] + 1)
] + [
    # Every family with every option of the families table: the option rules kept and broken.
    {**with_family(family), **SETTINGS[option]} for family in FAMILY_NAMES for option in OPTIONS
]

CEL = celpy.Environment()


@functools.lru_cache(maxsize=None)
def cel_program(expression: str):
    """Compiled once per expression: compiling, not evaluating, is most of cel-python's time."""
    return CEL.program(CEL.compile(expression))


def cel_holds(expression: str, obj) -> bool:
    """OBJ: a JSON document, or one already converted (celpy.json_to_cel) to be shared by several rules."""
    converted = obj if isinstance(obj, celpy.celtypes.MapType) else celpy.json_to_cel(obj)
    return bool(cel_program(expression).evaluate({"self": converted}))


def changed(manifest: dict, changes: dict) -> dict:
    """A copy of MANIFEST with each dotted field set (DELETE removes it), parents made as needed."""
    result = copy.deepcopy(manifest)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = result
        for key in parents:
            node = node.setdefault(key, {})
        if value == "DELETE":
            node.pop(last, None)
        else:
            node[last] = value
    return result


def typed_spec(manifest: dict) -> TrainingJobSpec:
    # Built without the cross-field rules, so a job that breaks one still becomes a typed object.
    return TrainingJobSpec.model_validate(manifest["spec"], context={SKIP_RULES: True})


@pytest.fixture(scope="module")
def jobs() -> list[TrainingJobSpec]:
    example = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    return [typed_spec(changed(example, changes)) for changes in VARIATIONS]


def test_every_rules_cel_agrees_with_its_python_on_every_job(jobs):
    seen = {}
    for rules, level in LEVELS:
        for spec in jobs:
            # The API server's view: the job with its defaults filled in, unset fields absent.
            document = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
            if level is not None and level not in document:
                continue  # an absent object's rules are not evaluated (spec.pmg of a diffusion job)
            obj, typed = (document, spec) if level is None else (document[level], getattr(spec, level))
            converted = celpy.json_to_cel(obj)  # once for all the level's rules
            for rule in rules:
                python = rule.holds(typed)
                if rule.cel is not None:  # else the webhook's alone (the field is untyped in the CRD)
                    assert cel_holds(rule.cel, converted) == python, (rule.message, obj)
                seen.setdefault(rule.message, set()).add(python)
    never_broken = [message for message, outcomes in seen.items() if outcomes != {True, False}]
    assert not never_broken, f"add a variation that breaks (and one that keeps) each of: {never_broken}"


def test_python_refuses_with_the_messages_the_api_server_gives(example_manifest):
    from kubetune_api.manifest import ManifestError, parse_manifest

    for changes in VARIATIONS:
        manifest = changed(example_manifest, changes)
        spec = typed_spec(manifest)
        broken = [rule.message for rules, level in LEVELS for rule in rules
                  if (level is None or getattr(spec, level) is not None)
                  and not rule.holds(spec if level is None else getattr(spec, level))]
        if not broken:
            parse_manifest(manifest)
            continue
        with pytest.raises(ManifestError) as caught:
            parse_manifest(manifest)
        assert any(message in str(caught.value) for message in broken), (changes, str(caught.value))


# ---- rules on one field: the URI forms and the S3 endpoint (CEL beside a Python check) -------------

URIS = ["s3://bucket/x", "s3://my.bucket-1/a/b/", "s3://bucket", "s3://bucket/", "s3://bucket/a..b/c",
        "s3://Bucket/x", "s3://ab/x", "s3://b_u/x", "s3://bucket/a/../x", "s3://bucket/a//b", "s3://bucket/./a",
        "s3://bucket/..", "s3://bucket/x/.", "s3://bucket/a?v=1", "s3://bucket/a#f", "s3://bucket/a%2e",
        "s3://bucket/a\\b", "s3://", "gs://bucket/x", "s3:/bucket/x", "/data/pets", "relative/dir", "org/model"]
ENDPOINTS = ["https://s3.example.com", "http://127.0.0.1:9000/", "https://user:pw@s3.example.com",
             "http://key@minio:9000", "https://s3.example.com/path@x"]


def python_accepts(check, value: str) -> bool:
    try:
        check(value)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("uri", URIS)
def test_the_uri_rules_cel_agrees_with_its_python(uri):
    from kubetune_api.spec_uris import _STORAGE_URI_RULE, check_storage_uri

    assert cel_holds(_STORAGE_URI_RULE, uri) == python_accepts(check_storage_uri, uri), uri


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_endpoint_rules_cel_agrees_with_its_python(endpoint):
    from kubetune_api.spec_resources import EndpointUrl, check_endpoint_url

    [rule] = next(m.json_schema_extra for m in EndpointUrl.__metadata__
                  if getattr(m, "json_schema_extra", None))["x-kubernetes-validations"]
    assert cel_holds(rule["rule"], endpoint) == python_accepts(check_endpoint_url, endpoint), endpoint


def test_the_rules_without_cel_are_only_those_on_the_untyped_number_or_list_fields():
    """A rule the API server cannot evaluate is the webhook's alone: kept to the two fields whose
    number-or-list form a structural schema cannot type (spec.data.resolution and frames)."""
    webhook_only = [rule for rules, _ in LEVELS for rule in rules if rule.cel is None]
    assert webhook_only and all("spec.data.resolution" in rule.message or "spec.data.frames" in rule.message
                                for rule in webhook_only)
