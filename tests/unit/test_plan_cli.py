"""`kubetune plan` refuses what it cannot plan, naming the option or the field; `validate` stays torch-free."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from kubetune_cli.main import cli


def manifest(tmp_path, pretrained) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "planned"},
        "spec": {"model": {"family": "sd15", "pretrained": str(pretrained)},
                 "data": {"layout": "captions", "uri": "/data"}, "training": {"maxSteps": 1},
                 "checkpoints": {"uri": "/ck"}},
    }))
    return str(path)


def test_a_pretrained_folder_without_configs_names_the_field_and_the_file(tmp_path):
    (tmp_path / "model").mkdir()
    result = CliRunner().invoke(cli, ["plan", "-f", manifest(tmp_path, tmp_path / "model")])
    assert result.exit_code == 2
    assert f"cannot plan: spec.model.pretrained: {tmp_path}/model/unet/config.json is missing" in result.output
    assert "kubetune dev tiny-model --family sd15 --full-size --config-only" in result.output


@pytest.mark.parametrize("args, expected", [
    (["--gpu-memory-gib", "eighty"], "Invalid value for '--gpu-memory-gib': 'eighty' is not a valid float"),
    (["--gpu-memory-gib", "0"], "Invalid value for '--gpu-memory-gib': 0.0 is not in the range"),
    (["--gpus-per-node", "17"], "Invalid value for '--gpus-per-node': 17 is not in the range 1<=x<=16"),
    (["--set", "spec.training.batchSize=0"], "spec.training.batchSize: Input should be greater than or equal to 1"),
])
def test_bad_options_are_named(tmp_path, args, expected):
    result = CliRunner().invoke(cli, ["plan", "-f", manifest(tmp_path, tmp_path), *args])
    assert result.exit_code in (1, 2)
    assert expected in result.output


def test_validate_and_the_cli_start_without_torch():
    code = "import sys, kubetune_cli.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("option, declared, expected_gib", [
    (None, None, 80), (None, "141Gi", 141), (24.0, "141Gi", 24),
])
def test_gpu_memory_comes_from_the_option_then_the_spec_then_80gi(option, declared, expected_gib):
    from kubetune_api.spec_resources import ResourcesSpec
    from kubetune_cli.plan import gpu_memory_bytes

    class Spec:
        resources = ResourcesSpec(gpu_memory=declared)

    assert gpu_memory_bytes(Spec(), option) == expected_gib * 2**30
