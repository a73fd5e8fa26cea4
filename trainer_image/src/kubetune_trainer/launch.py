"""Starting the trainer's processes on this machine: in this process, or several under the launcher."""
from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import yaml

from kubetune_api.spec import TrainingJob
from kubetune_trainer.launcher import NodePlace, launch


def trainer_command(config: Path, trainer_args: tuple[str, ...] = ()) -> list[str]:
    """The argv of one trainer process."""
    return [sys.executable, "-m", "kubetune_trainer", "--config", str(config), *trainer_args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(job: TrainingJob, directory: Path) -> Path:
    """The resolved manifest (overrides applied), as the trainer processes will read it."""
    path = directory / "trainingjob.yaml"
    path.write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False))
    return path


def launch_local(job: TrainingJob, nproc: int | None = None, trainer_args: tuple[str, ...] = ()) -> int:
    """Run the job on this machine (trainer_args: e.g. --cache-only); returns the exit code.

    nproc defaults to the job's processes per node, as in a pod. One process runs here, in this
    process; several run under the launcher (this process), which SIGTERM and Ctrl-C stop cleanly.
    """
    nproc = nproc or job.spec.processes_per_node
    with tempfile.TemporaryDirectory(prefix="kubetune-") as tmp:
        config = write_config(job, Path(tmp))
        if nproc == 1:
            from kubetune_trainer.__main__ import main

            return main(["--config", str(config), *trainer_args])
        place = NodePlace(processes=nproc, master_port=free_port())
        return launch(trainer_command(config, trainer_args), place, dict(os.environ))
