"""Starting the trainer's processes: in this process, or several under `accelerate launch`."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from kubetune_api.spec import TrainingJob


def trainer_command(config: Path, nproc: int, nnodes: int = 1, node_rank: int = 0,
                       master_addr: str = "127.0.0.1", master_port: int = 29500,
                       mixed_precision: str = "no", trainer_args: tuple[str, ...] = ()) -> list[str]:
    """The argv that starts `nproc` trainer processes on this node.

    Several processes: `accelerate launch --multi_gpu`, Accelerate's torchrun launcher, which
    also serves CPU-only processes (they rendezvous over gloo) and forwards SIGTERM to them.
    One process: the trainer itself, so that SIGTERM reaches it directly (Accelerate's simple
    launcher would leave its child running when it is terminated).
    """
    trainer = ["-m", "kubetune_trainer", "--config", str(config), *trainer_args]
    if nproc * nnodes == 1:
        return [sys.executable, *trainer]
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", str(nproc * nnodes), "--num_machines", str(nnodes),
        "--machine_rank", str(node_rank), "--main_process_ip", master_addr,
        "--main_process_port", str(master_port),
        "--mixed_precision", mixed_precision, "--dynamo_backend", "no", *trainer,
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(job: TrainingJob, directory: Path) -> Path:
    """The resolved manifest (overrides applied), as the trainer processes will read it."""
    path = directory / "trainingjob.yaml"
    path.write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False))
    return path


def launch_local(job: TrainingJob, nproc: int = 1, trainer_args: tuple[str, ...] = ()) -> int:
    """Run the job on this machine (trainer_args: e.g. --cache-only); returns the exit code."""
    if nproc == 1:
        from kubetune_trainer.__main__ import main

        with tempfile.TemporaryDirectory(prefix="kubetune-") as tmp:
            return main(["--config", str(write_config(job, Path(tmp))), *trainer_args])
    with tempfile.TemporaryDirectory(prefix="kubetune-") as tmp:
        command = trainer_command(write_config(job, Path(tmp)), nproc, master_port=free_port(),
                                     mixed_precision=job.spec.training.mixed_precision,
                                     trainer_args=trainer_args)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        return subprocess.call(command, env=env)
