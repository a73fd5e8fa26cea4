"""`kubetune plan` on the real architectures: activations measured by a training forward on fake tensors."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from kubetune_api.spec import LAYOUTS_BY_FAMILY, TrainingJobSpec
from kubetune_trainer.planning import choose_strategy
from kubetune_trainer.planning.estimate import Planner

pytestmark = pytest.mark.slow
GIB = 2**30


def spec_for(configs, family, resolution=512, batch=1, **training) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "model": {"family": family, "pretrained": str(configs[family])},
        "data": {"layout": LAYOUTS_BY_FAMILY[family][0], "uri": "/data", "resolution": resolution},
        "training": {"maxSteps": 1, "batchSize": batch, "mixedPrecision": "bf16", **training},
        "checkpoints": {"uri": "/ck"},
    })


@pytest.mark.parametrize("family, low, high", [
    ("sd15", 3.0, 4.5), ("sdxl", 3.0, 4.5), ("flux-kontext", 2.5, 4.5), ("qwen-image-edit", 3.0, 4.5),
    ("pmg", 1.2, 4.5),  # the LM's share does not grow with the image
])
def test_fused_attention_activations_grow_with_pixels_not_their_square(configs, planner, family, low, high):
    small = planner.activations(spec_for(configs, family, 512))
    large = planner.activations(spec_for(configs, family, 1024))
    assert small.saved > 0.1 * GIB
    assert low <= large.saved / small.saved <= high


def test_classifier_activations_grow_linearly_with_the_batch(configs, planner):
    # Plus a constant: autocast's bf16 copies of the frozen fp32 weights, saved once per step.
    eight, sixteen, thirty_two = (planner.activations(spec_for(configs, "classifier", 224, batch=batch)).saved
                                  for batch in (8, 16, 32))
    assert thirty_two - sixteen == pytest.approx(2 * (sixteen - eight), rel=0.05)
    assert sixteen - eight > 0.3 * GIB


def test_the_math_kernel_also_keeps_the_attention_matrices(configs, planner):
    spec = spec_for(configs, "sd15", 512)
    fused = planner.activations(spec).saved
    math = Planner("cuda", attention="math").activations(spec).saved
    # SD1.5 at 512 px: 8 heads x 4096 x 4096 bf16 scores at the 64x64 level, several layers
    assert math - fused > 1.0 * GIB


@pytest.mark.parametrize("family", ["sd15", "flux-kontext"])
def test_gradient_checkpointing_keeps_block_inputs_and_rebuilds_one_block(configs, planner, family):
    plain = planner.activations(spec_for(configs, family, 512))
    checkpointed = planner.activations(spec_for(configs, family, 512, gradientCheckpointing=True))
    assert checkpointed.saved < plain.saved / 2
    assert 0 < checkpointed.recompute < plain.saved / 4


@pytest.mark.parametrize("family, gpu_gib, expected", [
    ("sd15", 24, "ddp"),
    ("flux-kontext", 40, "fsdp"),   # 12B transformer + T5-XXL: 1024 px does not fit 40 GiB unsharded
])
def test_choose_strategy_for_auto(configs, family, gpu_gib, expected):
    assert choose_strategy(spec_for(configs, family, 1024), 4, gpu_gib * GIB) == expected


def write_manifest(tmp_path, configs, family, resolution) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "planned"},
        "spec": {"model": {"family": family, "pretrained": str(configs[family])},
                 "data": {"layout": LAYOUTS_BY_FAMILY[family][0], "uri": "/data", "resolution": resolution},
                 "training": {"maxSteps": 1, "mixedPrecision": "bf16"}, "checkpoints": {"uri": "/ck"}},
    }))
    return str(path)


def test_plan_reports_a_job_that_does_not_fit_with_fixes_that_do(tmp_path, configs):
    from kubetune_cli.main import cli

    result = CliRunner().invoke(cli, ["plan", "-f", write_manifest(tmp_path, configs, "sdxl", 1024),
                                      "--gpu-memory-gib", "12", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["fits"] is False and plan["estimate"]["total"] > 12 * GIB
    assert plan["estimate"]["parameters"] == pytest.approx(3.48e9, rel=0.01)
    assert plan["suggestions"] and all(s["estimate"]["total"] <= 12 * GIB for s in plan["suggestions"])
    assert ["spec.training.gradientCheckpointing=true"] in [s["overrides"] for s in plan["suggestions"]]


def test_plan_text_names_every_part_and_the_verdict(tmp_path, configs):
    from kubetune_cli.main import cli

    result = CliRunner().invoke(cli, ["plan", "-f", write_manifest(tmp_path, configs, "sd15", 512),
                                      "--nodes", "2", "--gpus-per-node", "4"])
    assert result.exit_code == 0, result.output
    for part in ("weights", "gradients", "optimizer state", "activations", "CUDA overhead", "fits in 80.00 GiB",
                 "ddp over 8 process(es)"):
        assert part in result.output
