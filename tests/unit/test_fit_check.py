"""The operator's fit check: torch-free estimates from kubetune_api.fit, a warning at admission and the
FitsGpu condition at reconcile."""
from __future__ import annotations

import kopf
import pytest

from kubetune_api.families import FAMILIES
from kubetune_api.fit import coarse_estimate, fit_problem
from kubetune_api.spec import LAYOUTS_BY_FAMILY, TrainingJob
from kubetune_operator.fit_check import fit_warning, fits_gpu_conditions
from kubetune_operator.settings import Settings

GIB = 2**30
NOW = "2026-11-23T12:00:00Z"


def job(family="sd15", resolution=512, **spec) -> TrainingJob:
    document = {"model": {"family": family, "pretrained": "s3://models/x"},
                "data": {"layout": LAYOUTS_BY_FAMILY[family][0], "uri": "s3://data/x", "resolution": resolution},
                "training": {"maxSteps": 10, "mixedPrecision": "bf16"}, "checkpoints": {"uri": "s3://ckpt/x"}}
    for section, values in spec.items():
        document.setdefault(section, {}).update(values)
    return TrainingJob.model_validate({"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "j", "namespace": "team"}, "spec": document})


def test_every_family_row_carries_its_profile():
    assert all(family.profile is not None for family in FAMILIES.values())


@pytest.mark.parametrize("family, resolution, low_gib, high_gib", [
    ("sd15", 512, 3, 8),            # SD1.5 LoRA, bf16, batch 1
    ("sdxl", 1024, 12, 20),
    ("flux-kontext", 1024, 70, 100),
    ("qwen-image-edit", 1024, 100, 150),
])
def test_coarse_estimates_are_in_the_range_of_the_real_architectures(family, resolution, low_gib, high_gib):
    assert low_gib * GIB < coarse_estimate(job(family, resolution).spec).total < high_gib * GIB


def test_each_option_moves_the_estimate_the_right_way():
    base = coarse_estimate(job("sdxl", 1024).spec).total
    assert coarse_estimate(job("sdxl", 1024, training={"gradientCheckpointing": True}).spec).total < base
    assert coarse_estimate(job("sdxl", 1024, model={"quantization": "nf4"}).spec).total < base
    assert coarse_estimate(job("sdxl", 1024, training={"batchSize": 4}).spec).total > base
    assert coarse_estimate(job("sdxl", 1024, adapter={"type": "full"}).spec).total > 2 * base
    sharded = job("sdxl", 1024, adapter={"type": "full"}, distributed={"strategy": "fsdp"},
                  resources={"gpusPerNode": 8})
    assert coarse_estimate(sharded.spec).total < coarse_estimate(job("sdxl", 1024, adapter={"type": "full"}).spec).total


def test_a_job_that_fits_has_no_problem_and_a_cpu_job_is_not_checked():
    assert fit_problem(job("sd15").spec, 80 * GIB) is None
    assert fit_problem(job("flux-kontext", 1024, resources={"gpusPerNode": 0}).spec, 1 * GIB) is None


def test_auto_on_several_gpus_is_fine_when_fsdp_fits():
    many = job("flux-kontext", 1024, resources={"gpusPerNode": 8}, training={"gradientCheckpointing": True})
    assert fit_problem(many.spec, 24 * GIB) is None
    assert fit_problem(job("flux-kontext", 1024, distributed={"strategy": "ddp"}, resources={"gpusPerNode": 8},
                           training={"gradientCheckpointing": True}).spec, 24 * GIB) is not None


def test_the_warning_names_the_estimate_and_fixes_that_fit():
    warning = fit_warning(job("sdxl", 1024), default_gpu_memory="12Gi")
    assert warning.startswith("FitsGpu: estimated ") and "more than the 12 GiB of one GPU" in warning
    assert "spec.training.gradientCheckpointing=true" in warning and "kubetune plan -f JOB.yaml" in warning


def test_the_jobs_own_gpu_memory_wins_over_the_default():
    assert fit_warning(job("sdxl", 1024, resources={"gpuMemory": "80Gi"}), default_gpu_memory="12Gi") is None
    assert fit_warning(job("sdxl", 1024, resources={"gpuMemory": "12Gi"}), default_gpu_memory="80Gi") is not None


def test_reconcile_sets_fits_gpu_false_with_reason_and_true_when_it_fits():
    conditions = fits_gpu_conditions({}, job("sdxl", 1024, resources={"gpuMemory": "12Gi"}), "80Gi", NOW)
    [fits] = conditions
    assert (fits["type"], fits["status"], fits["reason"]) == ("FitsGpu", "False", "InsufficientGpuMemory")
    assert "GiB per GPU" in fits["message"] and fits["lastTransitionTime"] == NOW
    ok = fits_gpu_conditions({"conditions": conditions}, job("sdxl", 1024), "80Gi", "later")
    assert [(c["type"], c["status"], c["reason"], c["lastTransitionTime"]) for c in ok] == [
        ("FitsGpu", "True", "EstimateFits", "later")]
    assert fits_gpu_conditions({"conditions": ok}, job("sdxl", 1024), "80Gi", "even later") is None  # unchanged
    assert fits_gpu_conditions({}, job("sdxl", 1024, resources={"gpusPerNode": 0}), "1Gi", NOW) is None


def test_the_admission_webhook_warns_but_admits():
    from kubetune_operator import handlers

    warnings: list[str] = []
    body = kopf.Body({"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob",
                      "metadata": {"name": "big", "namespace": "team"},
                      "spec": job("flux-kontext", 1024, resources={"gpuMemory": "24Gi"}).spec.model_dump(
                          mode="json", by_alias=True, exclude_none=True)})
    handlers.validate_new_job(body=body, warnings=warnings)  # no AdmissionError: a warning, not a refusal
    assert len(warnings) == 1 and warnings[0].startswith("FitsGpu: estimated")


@pytest.mark.parametrize("value", ["80GB", "lots"])
def test_a_bad_default_gpu_memory_stops_the_operator_naming_the_setting(value):
    with pytest.raises(ValueError, match=r"KUBETUNE_DEFAULT_GPU_MEMORY \(Helm value trainer.gpuMemory\): "):
        Settings.from_env({"KUBETUNE_DEFAULT_GPU_MEMORY": value})


def test_the_default_gpu_memory_is_80gi():
    assert Settings.from_env({}).default_gpu_memory == "80Gi"
    assert Settings.from_env({"KUBETUNE_DEFAULT_GPU_MEMORY": "141Gi"}).default_gpu_memory == "141Gi"


@pytest.mark.parametrize("value, message", [
    ("80GB", "String should match pattern"),
    ("512Mi", "spec.resources.gpuMemory '512Mi' is outside 1Gi-4Ti"),
])
def test_a_bad_gpu_memory_in_the_spec_is_refused_naming_the_field(value, message):
    from kubetune_api.manifest import ManifestError, parse_manifest

    document = job().model_dump(mode="json", by_alias=True, exclude_none=True)
    document["spec"]["resources"]["gpuMemory"] = value
    with pytest.raises(ManifestError) as err:
        parse_manifest(document)
    assert "spec.resources.gpuMemory" in str(err.value) and message in str(err.value)
