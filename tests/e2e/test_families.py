"""Each family issues 25 and 26 added trains through the operator: its example manifest, pointed at
its tiny model and data in S3, applied with kubectl; every job Succeeds and its LoRA lands in S3.
Wan's example trains on video clips, so its job reads real .mp4 clips from S3.

All of them are applied at once (one pod each, tiny models, two CPU steps) and run on one backend:
what differs between families is inside the trainer pod, which both backends create alike
(tests/e2e/test_operator.py runs the SD1.5 example on each backend).
"""
from __future__ import annotations

import pytest
import yaml

from kubetune_api.spec_data import VIDEO_LAYOUTS
from kubetune_trainer.data.tiny_data import write_tiny_data
from kubetune_trainer.models.tiny_models import write_tiny_model
from tests.conftest import REPO
from tests.e2e.jobs import BUCKET, kubectl, operator_log, phase, rank0_pod_logs
from tests.e2e.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("backend", ["trainjob"], indirect=True)]

# The families of issues 25 and 26 (today's image models, Wan video); each must have an example.
TINY_FRAMES = 5  # frames per clip of a video layout: Wan's 4k+1, two latent frames
NEW_FAMILIES = ("z-image", "sd35", "qwen-image", "qwen-image-edit-plus", "flux2", "flux2-klein", "wan")


def example_of(family: str) -> dict:
    """The family's example manifest in manifests/examples/ (the one naming it)."""
    for path in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        manifest = yaml.safe_load(path.read_text())
        if manifest["spec"]["model"]["family"] == family:
            return manifest
    raise AssertionError(f"no example manifest in manifests/examples/ for family {family}")


def tiny_cpu_job(family: str, inputs: dict[str, str]) -> dict:
    """The example as a two-step CPU job on the tiny model and data in S3: only what a CPU and a
    tiny model cannot do is changed (GPU options, sizes, length, the public hub's CLIP)."""
    manifest = example_of(family)
    name = f"family-{family}"
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec["model"]["pretrained"] = inputs["model"]
    spec["model"].pop("quantization", None)
    spec["data"].update(uri=inputs["data"], resolution=32, bucketing=False)
    if "frames" in spec["data"]:
        spec["data"]["frames"] = TINY_FRAMES  # the clips stay in S3 and are copied by the trainer (streaming off)
    spec["data"].pop("cache", None)
    spec["training"] = {"maxSteps": 2, "batchSize": 1, "learningRate": 1e-4, "mixedPrecision": "no"}
    spec["validation"] = {}
    spec["checkpoints"] = {"uri": f"s3://{BUCKET}/families", "everySteps": 2}
    spec["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec.pop("distributed", None)
    spec["s3"] = {"credentialsSecret": "s3-credentials"}
    return manifest


@pytest.fixture(scope="module")
def family_inputs(s3, tmp_path_factory):
    """Each family's tiny model and a data set of its layout, uploaded as a user would stage them."""
    root = tmp_path_factory.mktemp("family-inputs")
    inputs = {}
    for family in NEW_FAMILIES:
        layout = example_of(family)["spec"]["data"]["layout"]  # one of the family's layouts
        clips = {"frames": TINY_FRAMES} if layout in VIDEO_LAYOUTS else {}  # wan's example trains on .mp4 clips
        for local, prefix in ((write_tiny_model(family, root / family), f"models/{family}"),
                              (write_tiny_data(layout, root / f"data-{layout}", count=4, size=32, **clips),
                               f"data/{layout}")):
            for path in sorted(p for p in local.rglob("*") if p.is_file()):
                s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local)}")
        inputs[family] = {"model": f"s3://{BUCKET}/models/{family}", "data": f"s3://{BUCKET}/data/{layout}"}
    return inputs


def test_every_new_family_trains_through_the_operator_and_its_lora_lands_in_s3(
        control_plane, api_client, core, backend, operator_release, job_namespace, family_inputs, s3):
    """Over a minute: every new family's tiny job at once through one operator, one pod each loading its model
    side by side on two cores; one e2e for the whole matrix instead of a job per family."""
    for family in NEW_FAMILIES:
        kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-",
                input=yaml.safe_dump(tiny_cpu_job(family, family_inputs[family])))

    def finished():
        phases = {family: phase(api_client, job_namespace, f"family-{family}") for family in NEW_FAMILIES}
        return all(p in ("Succeeded", "Failed") for p in phases.values()) and phases

    phases = eventually(finished, timeout=900, interval=3,
                        message=lambda: "every family's job finished; operator log:\n" + operator_log(control_plane, core))
    for family, result in phases.items():
        logs = rank0_pod_logs(control_plane, backend, job_namespace, f"family-{family}")
        assert result == "Succeeded", f"{family}: " + (logs[-1][-3000:] if logs else "no trainer log")
        run = f"families/{job_namespace}/family-{family}/v0"
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run}/")["Contents"]}
        assert f"{run}/pytorch_lora_weights.safetensors" in keys, (family, sorted(keys)[:20])
