"""The trainer image's entry point in a training pod: the pod's main process.

The Kubeflow controller injects where this pod stands in the job (PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE, MASTER_ADDR/PET_MASTER_ADDR, MASTER_PORT/PET_MASTER_PORT). One process in
the whole job: the trainer replaces this process, so the kubelet's SIGTERM reaches it directly.
Otherwise this process becomes the node's launcher (kubetune_trainer.process.launcher), which starts one
trainer per GPU (or per processesPerNode on the CPU) and answers for them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from kubetune_api.contract import CACHE_STAGE_FIRST, HUB_TOKEN_ENV, MODELS_STAGE_COMMAND, NodeEnv
from kubetune_api.ports import free_listen_port
from kubetune_trainer.process.cpu_threads import thread_env
from kubetune_trainer.process.start import trainer_command
from kubetune_trainer.process.launcher import NodePlace, launch


def node_place(env: dict[str, str]) -> NodePlace:
    """This pod's place in the job from the environment the Kubeflow controller injects."""
    node = NodeEnv.from_env(env)
    return NodePlace(processes=node.processes, nodes=node.nodes, node_rank=node.node_rank,
                     master_addr=node.master_addr, master_port=node.master_port)


def models_stage(config: Path) -> int:
    """Place the job's hub models (kubetune_trainer.models.hub_stage) in a process of its own, the only one
    given the hub token: it leaves this environment before any trainer inherits it."""
    from kubetune_api.hub import hub_inputs
    from kubetune_api.manifest import load_manifest

    token = os.environ.pop(HUB_TOKEN_ENV, None)
    if not hub_inputs(load_manifest(config).spec):
        return 0
    print("kubetune: models stage", flush=True)
    env = {**os.environ, **({HUB_TOKEN_ENV: token} if token else {})}
    return subprocess.run([sys.executable, *MODELS_STAGE_COMMAND[1:], "--config", str(config)],
                          env=env).returncode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.pod", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument(CACHE_STAGE_FIRST, action="store_true",
                        help="node 0 fills the embedding cache (one process) before this node trains: for pods "
                             "that share one template across nodes (TrainJob), where no init container can be node 0's")
    args = parser.parse_args(argv)
    from kubetune_api.manifest import ManifestError, load_manifest

    try:
        load_manifest(args.config)
    except ManifestError as err:
        print(f"{args.config}: invalid\n{err}", file=sys.stderr)
        sys.exit(2)
    models = models_stage(args.config)
    if models != 0:
        sys.exit(models)
    place = node_place(dict(os.environ))
    os.environ.update(thread_env(os.environ, place.processes))  # the pod's CPUs shared by its trainers
    if args.cache_stage and place.node_rank == 0:
        print("kubetune: cache stage", flush=True)
        stage = launch(trainer_command(args.config, ("--cache-only",)), NodePlace(processes=1, master_port=free_listen_port()))
        if stage != 0:
            sys.exit(stage)
    command = trainer_command(args.config)
    if place.world_size == 1:
        print("kubetune: " + " ".join(command[1:]), flush=True)
        os.execv(command[0], command)
    print(f"kubetune: node {place.node_rank} of {place.nodes}, {place.processes} process(es), "
          f"rendezvous at {place.master_addr}:{place.master_port}", flush=True)
    sys.exit(launch(command, place))


if __name__ == "__main__":
    main()
