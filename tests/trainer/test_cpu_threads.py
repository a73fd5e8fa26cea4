"""A pod's trainer takes the CPU threads its pod was given, not one per core of the node."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.trainer.conftest import tiny_job, tiny_sd15, captions_data, write_manifest  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pod_env,threads", [
    ({"KUBETUNE_CPU_REQUEST_MILLICORES": "1000", "KUBETUNE_CPU_LIMIT_MILLICORES": "64000"}, 1),
    ({"KUBETUNE_CPU_REQUEST_MILLICORES": "1000", "OMP_NUM_THREADS": "2"}, 2),  # the user's setting wins
], ids=["from-the-request", "users-omp-num-threads"])
def test_a_one_process_pod_takes_the_threads_of_its_cpu_request(tiny_job, tmp_path, pod_env, threads):
    """The entry point as a pod runs it (downward-API variables set, as the operator sets them)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update(PYTHONUNBUFFERED="1", **pod_env)
    config = write_manifest(tiny_job(maxSteps=1), tmp_path)
    result = subprocess.run([sys.executable, "-m", "kubetune_trainer.entrypoint", "--config", str(config)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(1 process(es), {threads} CPU thread(s) each)" in result.stderr, result.stderr[-3000:]
