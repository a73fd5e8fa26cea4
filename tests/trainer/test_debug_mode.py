"""`kubetune train --debug` on the tiny SD1.5: three steps, anomaly detection on, and a job whose
checkpoints go to s3:// uploads nothing (its S3 endpoint is a closed port: any upload would fail)."""
from __future__ import annotations

import sys

from kubetune_api.ports import free_listen_port
from tests import warm_python
from tests.trainer.conftest import run_dir, trainer_env, write_manifest


def test_a_debug_run_trains_three_steps_locally_with_anomaly_detection(tiny_job, tmp_path):
    manifest = tiny_job(maxSteps=40)
    manifest["spec"]["checkpoints"]["uri"] = "s3://nowhere-bucket/runs"
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {**trainer_env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_listen_port()}",
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    result = warm_python.run([sys.executable, "-m", "kubetune_cli.main", "train", "--debug", "-f",
                              str(write_manifest(manifest, tmp_path))], cwd=workdir, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "autograd anomaly detection is on" in result.stderr
    run = run_dir(workdir / "kubetune-debug")
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3"], "three steps, one checkpoint"
    assert any(run.glob("*.safetensors")), "the final weights, locally"
