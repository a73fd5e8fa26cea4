"""`make demo`, the README's first command, keeps working."""
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_the_demo_trains_the_example_and_prints_where_the_lora_is(tmp_path):
    result = subprocess.run(["bash", "scripts/demo.sh", str(tmp_path / "demo")], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lora = tmp_path / "demo" / "checkpoints" / "default" / "sd15-lora-demo" / "v0" / "pytorch_lora_weights.safetensors"
    assert lora.is_file()
    assert f"LoRA: {lora}" in result.stdout
