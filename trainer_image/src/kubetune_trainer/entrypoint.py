"""The trainer image's entry point in a training pod: the pod's main process.

The Kubeflow controller injects where this pod stands in the job (PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE, MASTER_ADDR/PET_MASTER_ADDR, MASTER_PORT/PET_MASTER_PORT). One process in
the whole job: the trainer replaces this process, so the kubelet's SIGTERM reaches it directly.
Otherwise this process becomes the node's launcher (kubetune_trainer.launcher), which starts one
trainer per GPU (or per processesPerNode on the CPU) and answers for them.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kubetune_trainer.launch import trainer_command
from kubetune_trainer.launcher import NodePlace, launch


def _first(env: dict[str, str], names: tuple[str, ...], default: str) -> str:
    return next((env[name] for name in names if env.get(name)), default)


def node_place(env: dict[str, str]) -> NodePlace:
    """This pod's place in the job from the environment the Kubeflow controller injects."""
    processes = _first(env, ("PET_NPROC_PER_NODE",), "1")
    return NodePlace(
        processes=int(processes) if processes.isdigit() else 1,
        nodes=int(_first(env, ("PET_NNODES",), "1").split(":")[-1]),  # "2" or an elastic "1:2"
        node_rank=int(_first(env, ("PET_NODE_RANK", "RANK"), "0")),
        master_addr=_first(env, ("PET_MASTER_ADDR", "MASTER_ADDR"), "127.0.0.1"),
        master_port=int(_first(env, ("PET_MASTER_PORT", "MASTER_PORT"), "29500")),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.entrypoint", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    from kubetune_api.manifest import ManifestError, load_manifest

    try:
        load_manifest(args.config)
    except ManifestError as err:
        print(f"{args.config}: invalid\n{err}", file=sys.stderr)
        sys.exit(2)
    place = node_place(dict(os.environ))
    command = trainer_command(args.config)
    if place.world_size == 1:
        print("kubetune: " + " ".join(command[1:]), flush=True)
        os.execv(command[0], command)
    print(f"kubetune: node {place.node_rank} of {place.nodes}, {place.processes} process(es), "
          f"rendezvous at {place.master_addr}:{place.master_port}", flush=True)
    sys.exit(launch(command, place))


if __name__ == "__main__":
    main()
