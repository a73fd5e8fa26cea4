"""spec.training.maxGradValue clips every gradient element before the step, on one process and
on two FSDP shards alike: after one plain SGD step from a zero-initialised LoRA B, no element of
B moved further than learningRate x maxGradValue (and without the clip some did)."""
from __future__ import annotations

import pytest

from tests.trainer.conftest import run_dir, trained_weights
from tests.trainer.test_distributed import train

pytestmark = pytest.mark.slow

LEARNING_RATE = 0.5
CLIP = 1e-4


def largest_lora_b_step(tiny_job, tmp_path, name: str, nproc: int = 1, strategy: str = "ddp", **training) -> float:
    manifest = tiny_job(maxSteps=1, optimizer="sgd", sgdMomentum=0.0, learningRate=LEARNING_RATE,
                        weightDecay=0.0, maxGradNorm=0.0, **training)
    manifest["spec"]["checkpoints"]["uri"] = str(tmp_path / name)
    manifest["spec"]["training"]["batchSize"] = 2 // nproc
    manifest["spec"]["distributed"] = {"strategy": strategy}
    train(manifest, tmp_path, nproc)
    weights = trained_weights(run_dir(tmp_path / name) / "checkpoint-1")
    return max(w.abs().max().item() for key, w in weights.items() if "lora_B" in key)


def test_clipping_by_value_bounds_every_element_of_the_step(tiny_job, tmp_path):
    unclipped = largest_lora_b_step(tiny_job, tmp_path, "plain")
    assert unclipped > 2 * LEARNING_RATE * CLIP, "without the clip the step is larger (else the test shows nothing)"
    for name, nproc, strategy in (("one", 1, "ddp"), ("fsdp", 2, "fsdp")):
        step = largest_lora_b_step(tiny_job, tmp_path, name, nproc, strategy, maxGradValue=CLIP)
        assert step <= LEARNING_RATE * CLIP * (1 + 1e-5), (name, step)
        assert step > 0.5 * LEARNING_RATE * CLIP, f"{name}: the clipped elements still moved by the clip"
