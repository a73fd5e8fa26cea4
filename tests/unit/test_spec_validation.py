"""The TrainingJob spec accepts the examples and rejects bad input, naming the field."""
import copy
from dataclasses import dataclass
from typing import Any

import pytest

from kubetune_api.families import FAMILIES
from kubetune_api.manifest import ManifestError, apply_overrides, load_manifest, parse_manifest
from kubetune_api.spec import CUDA_ONLY_OPTIONS
from tests.conftest import EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_manifest_validates(path):
    job = load_manifest(path)
    assert job.kind == "TrainingJob"


@dataclass(frozen=True)
class OnCpu:
    """A value set on a CPU job: with_change also sets spec.resources.gpusPerNode to 0."""

    value: Any

    def __repr__(self) -> str:
        return f"{self.value!r} with gpusPerNode 0"


def with_change(manifest: dict, dotted: str, value) -> dict:
    """A copy of the manifest with one field set (value DELETE removes it, OnCpu(v) sets v on a CPU job)."""
    if isinstance(value, OnCpu):
        return with_change(with_change(manifest, "spec.resources.gpusPerNode", 0), dotted, value.value)
    result = copy.deepcopy(manifest)
    *parents, last = dotted.split(".")
    node = result
    for key in parents:
        node = node[key]
    if value == "DELETE":
        del node[last]
    else:
        node[last] = value
    return result


BAD_INPUTS = [
    # (field, value, expected words in the message)
    ("spec.training.learningrate", 1e-4, ["spec.training.learningrate", "unknown field", "did you mean 'learningRate'"]),
    ("spec.trainng", {}, ["spec.trainng", "unknown field", "did you mean 'training'"]),
    ("spec.training.learningRate", 0, ["spec.training.learningRate", "greater than 0"]),
    ("spec.training.learningRate", -1e-4, ["spec.training.learningRate", "greater than 0"]),
    ("spec.training.learningRate", "fast", ["spec.training.learningRate", "valid number"]),
    ("spec.adapter.rank", 0, ["spec.adapter.rank", "greater than or equal to 1"]),
    ("spec.adapter.rank", 100000, ["spec.adapter.rank", "less than or equal to 1024"]),
    ("spec.training.batchSize", "4", ["spec.training.batchSize", "valid integer"]),
    ("spec.training.batchSize", "four", ["spec.training.batchSize", "valid integer"]),
    ("spec.model.family", "sd3", ["spec.model.family", "'sd15'", "'classifier'"]),
    ("spec.data.layout", "webdataset", ["spec.data.layout", "'captions'", "'edit-pairs'"]),
    ("spec.data.uri", "gs://bucket/data", ["spec.data.uri", "unsupported URI scheme 'gs'", "s3://bucket/prefix"]),
    ("spec.checkpoints.uri", "http://example/ckpt", ["spec.checkpoints.uri", "unsupported URI scheme 'http'"]),
    ("spec.model.pretrained", "s3://", ["spec.model.pretrained", "needs a bucket"]),
    # S3 URIs with odd characters (docs/hostile-input.md); the CRD's CEL rule refuses the same.
    ("spec.data.uri", "s3://My_Bucket/data", ["spec.data.uri", "'My_Bucket' is not an S3 bucket name"]),
    ("spec.checkpoints.uri", "s3://bucket/runs/../other", ["spec.checkpoints.uri", "'.' or '..' segment"]),
    ("spec.checkpoints.uri", "s3://bucket/runs//a", ["spec.checkpoints.uri", "empty, '.' or '..' segment"]),
    ("spec.data.uri", "s3://bucket/data?versionId=3", ["spec.data.uri", "contains '?'"]),
    ("spec.model.pretrained", "s3://bucket/models/sd%2015", ["spec.model.pretrained", "contains '%'"]),
    ("spec.checkpoints.resumeFrom", "s3://bucket/a\\b/checkpoint-5", ["spec.checkpoints.resumeFrom", "contains '\\\\'"]),
    ("spec.data.uri", "s3://bucket/da\nta", ["spec.data.uri", "contains '\\n'"]),
    ("spec.resources.gpusPerNode", -1, ["spec.resources.gpusPerNode", "greater than or equal to 0"]),
    ("spec.resources.nodes", 0, ["spec.resources.nodes", "greater than or equal to 1"]),
    ("spec.data.resolution", 513, ["spec.data.resolution", "multiples of 8"]),
    ("spec.data.resolution", [832], ["spec.data.resolution: give one side for a square", "or [width, height]"]),
    ("spec.data.resolution", [832, 570], ["spec.data.resolution", "each 8 to 4096 pixels in multiples of 8"]),
    ("spec.data.resolution", "big", ["spec.data.resolution"]),
    ("spec.training.gradientAccumulationSteps", 0, ["spec.training.gradientAccumulationSteps", "greater than or equal to 1"]),
    ("spec.model", "DELETE", ["spec.model", "Field required"]),
    ("spec.training.mixedPrecision", "fp8", ["spec.training.mixedPrecision", "'bf16'"]),
    ("spec.training.epochs", 3, ["maxSteps", "epochs", "not both"]),
    ("spec.training.maxSteps", "DELETE", ["spec.training.maxSteps or spec.training.epochs"]),
    ("spec.data.layout", "edit-pairs", ["spec.data.layout", "does not fit spec.model.family", "sd15 reads captions"]),
    ("metadata.name", "Bad_Name", ["metadata.name", "pattern"]),
    ("spec.model.quantization", "int4", ["spec.model.quantization", "'fp8'", "'nf4'"]),
    ("spec.adapter.initFrom", "gs://b/lora", ["spec.adapter.initFrom", "unsupported URI scheme 'gs'"]),
    ("spec.data.bucketing", "yes", ["spec.data.bucketing", "valid boolean"]),
    ("spec.data.controlDropout", 1.5, ["spec.data.controlDropout", "less than or equal to 1"]),
    ("spec.data.controlDropout", 0.1, ["spec.data.controlDropout is not honoured by family sd15", "flux-kontext, qwen-image-edit"]),
    ("spec.data.cache", {"enabled": True, "uri": "ftp://x"}, ["spec.data.cache.uri", "unsupported URI scheme"]),
    ("spec.training.optimizer", "adagrad", ["spec.training.optimizer", "'prodigy'", "'schedulefree-adamw'"]),
    ("spec.training.optimizer", "schedulefree-adamw", ["schedulefree-adamw", "lrScheduler to constant"]),
    ("spec.training.lrScheduler", "exponential", ["spec.training.lrScheduler", "'cosine-restarts'", "'plateau'"]),
    ("spec.training.lrCycles", 0, ["spec.training.lrCycles", "greater than or equal to 1"]),
    ("spec.training.lrGamma", 0, ["spec.training.lrGamma", "greater than 0"]),
    ("spec.training.emaDecay", 1.0, ["spec.training.emaDecay", "less than 1"]),
    ("spec.training.profileSteps", 0, ["spec.training.profileSteps", "greater than or equal to 1"]),
    ("spec.validation", {"heldOutFraction": 0.9}, ["spec.validation.heldOutFraction", "less than or equal to 0.5"]),
    ("spec.validation", {"monitor": "accuracy"}, ["spec.validation.monitor accuracy is reported by family classifier only"]),
    ("spec.validation", {"everySteps": 100, "monitor": "clip_score"}, [
        "spec.validation.monitor clip_score is measured by a CLIP model: set spec.validation.clipModel (a local "
        "path, an s3:// URI or a hub id such as openai/clip-vit-large-patch14), or monitor loss"]),
    ("spec.validation", {"monitor": "clip_directional", "clipModel": "/models/clip"}, [
        "spec.validation.monitor clip_directional is reported by family "
        + " and ".join(name for name, row in FAMILIES.items() if "clip_directional" in row.metrics) + " only"]),
    ("spec.validation", {"clipModel": "gs://models/clip"}, ["spec.validation.clipModel", "unsupported URI scheme"]),
    ("spec.validation", {"keepBest": 0}, ["spec.validation.keepBest", "greater than or equal to 1"]),
    ("spec.pmg", {"numImagePrompt": 2}, ["spec.pmg applies to family pmg only"]),
    ("spec.pmg", {"maxSequenceLength": 4}, ["spec.pmg.maxSequenceLength", "greater than or equal to 8"]),
    ("spec.data.uri", "s3:/bucket/data", ["spec.data.uri", "without its two slashes"]),
    ("spec.s3", {"endpointUrl": "http://key:secret@minio:9000"}, ["spec.s3.endpointUrl must not carry credentials"]),
    ("spec.distributed", {"strategy": "zero3"}, ["spec.distributed.strategy", "'auto'", "'ddp'", "'fsdp'"]),
    ("spec.distributed", {"cpuOffload": True}, ["spec.distributed.cpuOffload", "needs strategy fsdp"]),
    ("spec.distributed", {"processesPerNode": 2}, ["spec.distributed.processesPerNode", "one process per GPU"]),
    ("spec.distributed", {"processesPerNode": 0}, ["spec.distributed.processesPerNode", "greater than or equal to 1"]),
    ("spec.scheduling", {"workloadPriorityClass": "urgent"}, ["spec.scheduling.workloadPriorityClass",
                                                              "set spec.scheduling.queueName too"]),
    # CUDA-only options on a CPU job (spec.resources.gpusPerNode 0).
    ("spec.model.quantization", OnCpu("nf4"), [
        "spec.model.quantization nf4 needs a CUDA GPU: this job has spec.resources.gpusPerNode 0; "
        "remove quantization or request GPUs"]),
    ("spec.model.quantization", OnCpu("fp8"), ["spec.model.quantization fp8 needs a CUDA GPU", "gpusPerNode 0"]),
    ("spec.training.optimizer", OnCpu("adamw8bit"), ["spec.training.optimizer adamw8bit needs a CUDA GPU",
                                                     "spec.resources.gpusPerNode 0", "use adamw or request GPUs"]),
    ("spec.training.mixedPrecision", OnCpu("fp16"), ["spec.training.mixedPrecision fp16 needs a CUDA GPU",
                                                     "spec.resources.gpusPerNode 0", "use bf16"]),
    ("spec.distributed", OnCpu({"strategy": "fsdp", "cpuOffload": True}), [
        "spec.distributed.cpuOffload true needs a CUDA GPU", "spec.resources.gpusPerNode 0", "remove cpuOffload"]),
    ("spec.training", OnCpu({"maxSteps": 10, "compile": True, "compileMode": "reduce-overhead"}), [
        "spec.training.compileMode reduce-overhead needs a CUDA GPU", "use compileMode default"]),
    ("spec.training.attention", OnCpu("flash3"), ["spec.training.attention flash3 needs a CUDA GPU",
                                                  "use attention auto or sdpa"]),
    ("spec.model.encoderDevice", OnCpu("gpu"), ["spec.model.encoderDevice gpu needs a CUDA GPU",
                                               "use encoderDevice auto"]),
    # Speed and memory options.
    ("spec.model.encoderDevice", "cpu", ["spec.model.encoderDevice cpu needs spec.data.cache.enabled: true",
                                         "enable the cache, or use encoderDevice auto or gpu"]),
    ("spec.training", {"maxSteps": 10, "compileMode": "max-autotune-no-cudagraphs"}, [
        "spec.training.compileMode applies with spec.training.compile: true"]),
    ("spec.training.attention", "flash2", ["spec.training.attention", "'auto'", "'sdpa'", "'flash3'"]),
]

def test_a_quantized_base_trains_only_an_adapter(example_manifest):
    quantized = with_change(example_manifest, "spec.model.quantization", "nf4")
    parse_manifest(quantized)
    with pytest.raises(ManifestError, match="spec.model.quantization freezes the base model .* use spec.adapter.type lora"):
        parse_manifest(with_change(quantized, "spec.adapter", {"type": "full"}))


FSDP_CONFLICTS = [
    ("spec.model.quantization", "nf4", ["spec.model.quantization cannot be sharded by fsdp", "strategy ddp"]),
    ("spec.training.optimizer", "adamw8bit", ["spec.training.optimizer adamw8bit", "use adamw with fsdp"]),
    ("spec.training.mixedPrecision", "fp16", ["spec.training.mixedPrecision fp16", "use bf16 with fsdp"]),
]


@pytest.mark.parametrize("field,value,expected", FSDP_CONFLICTS, ids=[f for f, _, _ in FSDP_CONFLICTS])
def test_options_fsdp_cannot_shard_are_refused_naming_the_option_and_the_fix(example_manifest, field, value, expected):
    sharded = with_change(example_manifest, "spec.distributed", {"strategy": "fsdp"})
    parse_manifest(sharded)  # the example itself shards
    with pytest.raises(ManifestError) as caught:
        parse_manifest(with_change(sharded, field, value))
    for words in expected:
        assert words in str(caught.value), str(caught.value)
    parse_manifest(with_change(example_manifest, field, value))  # the same option under ddp is fine


def test_cuda_only_options_are_fine_on_a_gpu_job_and_every_one_is_refused_on_a_cpu_job(example_manifest):
    cpu_rows = [(field, value.value) for field, value, _ in BAD_INPUTS if isinstance(value, OnCpu)]
    for field, value in cpu_rows:
        parse_manifest(with_change(example_manifest, field, value))  # the example asks for one GPU
    refused = set()
    for field, value in cpu_rows:
        with pytest.raises(ManifestError) as caught:
            parse_manifest(with_change(example_manifest, field, OnCpu(value)))
        refused |= {option.field for option in CUDA_ONLY_OPTIONS if option.message in str(caught.value)}
    assert refused == {option.field for option in CUDA_ONLY_OPTIONS}, "a BAD_INPUTS row for every option"


def test_a_cpu_job_using_several_cuda_only_options_hears_of_each(example_manifest):
    job = with_change(with_change(example_manifest, "spec.training.optimizer", "adamw8bit"),
                      "spec.model.quantization", OnCpu("nf4"))
    with pytest.raises(ManifestError) as caught:
        parse_manifest(job)
    assert "spec.model.quantization nf4" in str(caught.value)
    assert "spec.training.optimizer adamw8bit" in str(caught.value)


@pytest.mark.parametrize("field,value,expected", BAD_INPUTS, ids=[f"{f}={v!r}" for f, v, _ in BAD_INPUTS])
def test_bad_input_is_rejected_naming_the_field(example_manifest, field, value, expected):
    with pytest.raises(ManifestError) as caught:
        parse_manifest(with_change(example_manifest, field, value))
    message = str(caught.value)
    for words in expected:
        assert words in message, message


def test_every_problem_is_reported_at_once(example_manifest):
    bad = with_change(with_change(example_manifest, "spec.adapter.rank", 0), "spec.training.batchSize", "x")
    with pytest.raises(ManifestError) as caught:
        parse_manifest(bad)
    assert len(caught.value.problems) == 2


def test_overrides_parse_values_as_yaml(example_manifest):
    changed = apply_overrides(example_manifest, ["spec.training.maxSteps=2", "spec.data.uri=/tmp/x",
                                                 "spec.training.learningRate=1e-3"])
    job = parse_manifest(changed)
    assert job.spec.training.max_steps == 2
    assert job.spec.data.uri == "/tmp/x"
    assert job.spec.training.learning_rate == pytest.approx(1e-3)
    assert example_manifest["spec"]["training"]["maxSteps"] == 1000, "the original is left alone"


def test_an_override_without_equals_sign_is_refused(example_manifest):
    with pytest.raises(ManifestError, match="expected PATH=VALUE"):
        apply_overrides(example_manifest, ["spec.training.maxSteps"])


def test_defaults_fill_what_the_manifest_leaves_out(example_manifest):
    minimal = copy.deepcopy(example_manifest)
    del minimal["spec"]["adapter"], minimal["spec"]["resources"]
    job = parse_manifest(minimal)
    assert job.spec.adapter.type == "lora" and job.spec.adapter.rank == 8
    assert job.spec.resources.nodes == 1


def test_validate_command_reports_the_verdict(tmp_path, example_manifest):
    import yaml
    from click.testing import CliRunner

    from kubetune_cli.main import cli

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(example_manifest))
    ok = CliRunner().invoke(cli, ["validate", "-f", str(path)])
    assert ok.exit_code == 0 and "valid TrainingJob 'sd15-lora-demo'" in ok.output
    bad = CliRunner().invoke(cli, ["validate", "-f", str(path), "--set", "spec.adapter.rank=0"])
    assert bad.exit_code == 2 and "spec.adapter.rank" in bad.output
    # Valid for `kubetune train -f`, which reads local paths on this machine; a cluster's pods need volumes.
    example_manifest["spec"].pop("volumes")
    path.write_text(yaml.safe_dump(example_manifest))
    local = CliRunner().invoke(cli, ["validate", "-f", str(path)])
    assert local.exit_code == 0 and "valid TrainingJob 'sd15-lora-demo'" in local.output
    assert f"{path}: on a cluster, kubectl apply refuses it: spec.data.uri: on a cluster a local path" in local.output


def test_an_unquoted_no_gets_a_quoting_hint(example_manifest):
    changed = apply_overrides(example_manifest, ["spec.training.mixedPrecision=no"])
    with pytest.raises(ManifestError, match='write "no"'):
        parse_manifest(changed)
    quoted = apply_overrides(example_manifest, ['spec.training.mixedPrecision="no"'])
    assert parse_manifest(quoted).spec.training.mixed_precision == "no"


def test_a_resolution_the_familys_patches_do_not_divide_is_refused_naming_the_field(example_manifest):
    from kubetune_api.families import FAMILIES

    patched = [name for name, family in FAMILIES.items() if family.resolution_multiple > 8]
    assert patched, "the DiT families cut latents into 2x2 patches"
    for family in patched:
        manifest = with_change(with_change(example_manifest, "spec.model.family", family), "spec.data.layout",
                               FAMILIES[family].layouts[0])
        manifest["spec"]["training"].pop("snrGamma", None)  # a DDPM option the flow-matching families refuse
        parse_manifest(with_change(manifest, "spec.data.resolution", 1024))
        parse_manifest(with_change(manifest, "spec.data.resolution", [832, 576]))
        for bad in (1000, [832, 584]):
            with pytest.raises(ManifestError, match=f"spec.data.resolution must be a multiple of "
                                                    f"{FAMILIES[family].resolution_multiple} for family {family}"):
                parse_manifest(with_change(manifest, "spec.data.resolution", bad))
