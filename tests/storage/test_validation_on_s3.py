"""A run whose checkpoints go to s3:// keeps its validation images there too, beside the checkpoints,
and reads its CLIP model (spec.validation.clipModel) from s3:// like its base model."""
from __future__ import annotations

import re

import pytest

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.uri import parse_s3
from tests.storage.test_trainer_on_s3 import upload_dir
from tests.trainer.conftest import captions_data, tiny_clip, tiny_job, tiny_sd15, run_trainer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def test_validation_samples_and_the_clip_model_travel_through_s3(bucket, tiny_job, tiny_clip, tmp_path, monkeypatch):
    upload_dir(tiny_clip, f"s3://{bucket}/models/clip")
    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KUBETUNE_STAGING_DIR", str(tmp_path / "staging"))
    manifest = tiny_job(maxSteps=2)
    manifest["spec"]["checkpoints"].update(uri=f"s3://{bucket}/runs", everySteps=2)
    manifest["spec"]["validation"] = {"everySteps": 1, "prompts": ["a red circle"], "numInferenceSteps": 2,
                                      "clipModel": f"s3://{bucket}/models/clip"}
    result = run_trainer(manifest, tmp_path)
    assert re.search(r"validation at step 2: clip_score [\d.]+", result.stderr), result.stderr[-3000:]

    objects = s3.list_objects(parse_s3(f"s3://{bucket}/runs/default/tiny/v0"))
    assert {"samples/step-0000001/0.png", "samples/step-0000002/0.png"} <= set(objects), sorted(objects)
    assert "checkpoint-2/manifest.json" in objects
