"""A pod's trainers take the CPU threads their pod was given, shared among them, not one per core
of the node."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kubetune_api.ports import free_listen_port
from tests.trainer.conftest import tiny_job, tiny_sd15, captions_data, write_manifest  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("processes,pod_env,threads", [
    (1, {"KUBETUNE_CPU_REQUEST_MILLICORES": "1000", "KUBETUNE_CPU_LIMIT_MILLICORES": "64000"}, 1),
    (1, {"KUBETUNE_CPU_REQUEST_MILLICORES": "1000", "OMP_NUM_THREADS": "2"}, 2),  # the user's setting wins
    # Two CPUs requested for two processes: one thread each, not two (the pod's share, not each one's).
    (2, {"KUBETUNE_CPU_REQUEST_MILLICORES": "2000"}, 1),
], ids=["from-the-request", "users-omp-num-threads", "two-processes-share-the-request"])
def test_a_pods_processes_share_the_threads_of_its_cpu_request(tiny_job, tmp_path, processes, pod_env, threads):
    """The entry point as a pod runs it (downward-API and Kubeflow variables set, as the operator and
    the controller set them)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update(PYTHONUNBUFFERED="1", PET_NNODES="1", PET_NODE_RANK="0", PET_NPROC_PER_NODE=str(processes),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_listen_port()), **pod_env)
    config = write_manifest(tiny_job(maxSteps=1), tmp_path)
    result = subprocess.run([sys.executable, "-m", "kubetune_trainer.pod", "--config", str(config)],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"({processes} process(es), {threads} CPU thread(s) each)" in result.stderr, result.stderr[-3000:]
