"""The operator's torch-free profiles (each families row's `profile`, read by kubetune_api.fit) agree
with the meta-device estimator.

They are calibrated at 512 and 1024 px (the classifier at two batch sizes); it is checked here
at other sizes, within 10%, for the total per GPU and for the activations with working memory.
Re-calibrate with `python -m kubetune_trainer.planning.profiles` when an architecture or a recipe changes.
"""
from __future__ import annotations

import pytest

from kubetune_api.families import FAMILIES
from kubetune_api.fit import CoarseEstimator
from kubetune_api.spec import LAYOUTS_BY_FAMILY, TrainingJobSpec

pytestmark = pytest.mark.slow


# Every family of the table: at two other sizes, or (without a native resolution) at its model's own
# size with two other batches.
CASES = [(name, resolution, 1) for name, row in FAMILIES.items() if row.native_resolution
         for resolution in (768, 1280)] + [(name, row.profile.image_size, batch) for name, row in FAMILIES.items()
                                           if not row.native_resolution for batch in (12, 24)]


@pytest.mark.parametrize("family, resolution, batch", CASES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_table_agrees_with_the_meta_device_estimate(configs, planner, family, resolution, batch, checkpointing):
    spec = TrainingJobSpec.model_validate({
        "model": {"family": family, "pretrained": str(configs[family])},
        "data": {"layout": LAYOUTS_BY_FAMILY[family][0], "uri": "/data", "resolution": resolution},
        "training": {"maxSteps": 1, "batchSize": batch, "mixedPrecision": "bf16",
                     "gradientCheckpointing": checkpointing},
        "checkpoints": {"uri": "/ck"},
    })
    precise = planner.estimate(spec, 1, "ddp")
    coarse = CoarseEstimator().estimate(spec, 1, "ddp")
    assert coarse.total == pytest.approx(precise.total, rel=0.10)
    assert coarse.dynamic == pytest.approx(precise.activations + precise.backward_working, rel=0.10)
