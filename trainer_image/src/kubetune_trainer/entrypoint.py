"""The trainer image's entry point in a PyTorchJob pod.

The training operator injects where this pod stands in the job (PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT); this maps them onto `accelerate launch`, which
starts one trainer process per GPU (or one CPU process) on this node.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kubetune_trainer.launch import trainer_command


def launch_argv(config: Path, env: dict[str, str], mixed_precision: str) -> list[str]:
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    return trainer_command(
        config,
        nproc=int(nproc) if nproc.isdigit() else 1,
        nnodes=int(env.get("PET_NNODES", "1").split(":")[-1]),
        node_rank=int(env.get("PET_NODE_RANK", env.get("RANK", "0"))),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        mixed_precision=mixed_precision,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.entrypoint", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    from kubetune_api.manifest import ManifestError, load_manifest

    try:
        job = load_manifest(args.config)
    except ManifestError as err:
        print(f"{args.config}: invalid\n{err}", file=sys.stderr)
        sys.exit(2)
    command = launch_argv(args.config, dict(os.environ), job.spec.training.mixed_precision)
    print("kubetune: " + " ".join(command[1:]), flush=True)
    os.execv(command[0], command)  # the launcher becomes the container's main process (signals)


if __name__ == "__main__":
    main()
