"""Starting the trainer's processes on this machine: in this process, or several under the launcher."""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from kubetune_api.ports import free_listen_port
from kubetune_api.contract import TrainerEnv
from kubetune_api.spec import TrainingJob
from kubetune_trainer.process.launcher import NodePlace, launch
from kubetune_trainer.checkpoint.resume import job_manifest_text


def trainer_command(config: Path, trainer_args: tuple[str, ...] = ()) -> list[str]:
    """The argv of one trainer process."""
    return [sys.executable, "-m", "kubetune_trainer", "--config", str(config), *trainer_args]


def write_config(job: TrainingJob, directory: Path) -> Path:
    """The resolved manifest (overrides applied), as the trainer processes will read it."""
    path = directory / "trainingjob.yaml"
    path.write_text(job_manifest_text(job))
    return path


def s3_environment(job: TrainingJob) -> dict[str, str]:
    """spec.s3's endpoint, region and addressing as the environment the storage layer reads, as the
    operator renders them into a pod (credentials stay the shell's: a Secret is the cluster's)."""
    s3 = job.spec.s3
    env = {}
    if s3.endpoint_url:
        env["AWS_ENDPOINT_URL"] = s3.endpoint_url
    if s3.region:
        env["AWS_DEFAULT_REGION"] = s3.region
    if s3.path_style is not None:
        env[TrainerEnv.NAMES["s3_path_style"]] = str(s3.path_style).lower()
    return env


@contextmanager
def environment(changes: dict[str, str]):
    """os.environ with `changes` for the duration (a run inside a longer-lived process)."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch_local(job: TrainingJob, nproc: int | None = None, trainer_args: tuple[str, ...] = ()) -> int:
    """Run the job on this machine (trainer_args: e.g. --cache-only); returns the exit code.

    nproc defaults to the job's processes per node, as in a pod. One process runs here, in this
    process; several run under the launcher (this process), which SIGTERM and Ctrl-C stop cleanly.
    spec.s3's endpoint and region apply as they would in a pod.
    """
    nproc = nproc or job.spec.processes_per_node
    with tempfile.TemporaryDirectory(prefix="kubetune-") as tmp, environment(s3_environment(job)):
        config = write_config(job, Path(tmp))
        if nproc == 1:
            from kubetune_trainer.__main__ import main

            return main(["--config", str(config), *trainer_args])
        place = NodePlace(processes=nproc, master_port=free_listen_port())
        return launch(trainer_command(config, trainer_args), place, dict(os.environ))
