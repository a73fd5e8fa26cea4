"""spec.training.compile: the trained model's repeated blocks are compiled in place (regional
compilation, inductor on the CPU here), train as the eager model does, and keep its names."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.conftest import run_dir, run_trainer, trained_weights

pytestmark = pytest.mark.slow


def test_a_compiled_run_trains_like_the_eager_one_and_states_its_compile_time(tiny_sd15, captions_data, tmp_path):
    from tests.trainer.conftest import tiny_manifest

    eager = run_trainer(tiny_manifest(tiny_sd15, captions_data, tmp_path / "eager"), tmp_path)
    compiled = run_trainer(tiny_manifest(tiny_sd15, captions_data, tmp_path / "compiled", compile=True), tmp_path)

    said = re.search(r"torch.compile: (.*) \(mode default\) compiled in ([\d.]+) s "
                     r"\(the first step took ([\d.]+) s\)", compiled.stderr)
    assert said, compiled.stderr[-3000:]
    blocks = {name: int(count) for count, name in re.findall(r"(\d+) (\w+)", said[1])}
    seconds, first_step = float(said[2]), float(said[3])
    assert blocks == {"BasicTransformerBlock": 4}, "the tiny UNet's repeated (transformer) blocks, in place"
    assert 0 < seconds <= first_step + 1, "compiling happens inside the first step"
    assert "torch.compile" not in eager.stderr

    losses = [re.findall(r"step \d+/2 loss ([\d.]+)", result.stderr) for result in (eager, compiled)]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
    for name in ("eager", "compiled"):
        assert (run_dir(tmp_path / name) / "checkpoint-2").is_dir()
    eager_lora = load_file(run_dir(tmp_path / "eager") / "pytorch_lora_weights.safetensors")
    compiled_lora = load_file(run_dir(tmp_path / "compiled") / "pytorch_lora_weights.safetensors")
    assert eager_lora.keys() == compiled_lora.keys(), "compiled in place: the LoRA file's names are the eager ones"
    for key, value in eager_lora.items():
        torch.testing.assert_close(compiled_lora[key], value, rtol=1e-4, atol=1e-5)
    checkpoint_names = trained_weights(run_dir(tmp_path / "compiled") / "checkpoint-2").keys()
    assert checkpoint_names == trained_weights(run_dir(tmp_path / "eager") / "checkpoint-2").keys()
