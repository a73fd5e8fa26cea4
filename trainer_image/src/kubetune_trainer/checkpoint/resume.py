"""Where this run writes and where it starts from, decided once by the main process.

The main process looks up the run's version (checkpoint/runs.py) and picks the checkpoint to start
from, in this order:
  1. the newest intact checkpoint of this very run (a pod restarted after preemption);
  2. with resumeFrom: latest, the newest intact checkpoint of the job's earlier runs;
  3. with resumeFrom: <uri>, that checkpoint (it must be complete, else the run stops here);
  4. nothing: a fresh start.
Every other process learns the decision by broadcast, and each node's first process fetches the
chosen checkpoint to local disk. Looking up writes nothing: the run claims its version (deletes
abandoned ones, writes run.json) only once the starting checkpoint was found to fit the model
and the processes, so a refused resume leaves storage as it was.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from kubetune_api import layout
from kubetune_api.contract import TrainerEnv
from kubetune_api.spec_training import CheckpointSpec
from kubetune_api.spec import TrainingJob
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.checkpoint import runs
from kubetune_trainer.checkpoint.store import fetch_intact, local_path_for, newest_intact
from kubetune_trainer.storage.tree import open_tree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlace:
    version: int
    uri: str  # <checkpoints.uri>/<namespace>/<job>/v<N>
    start_from: str | None  # URI of the checkpoint to resume, None for a fresh start
    job_uri: str  # <checkpoints.uri>/<namespace>/<job>
    choice: runs.VersionChoice


def run_id_from_env() -> str | None:
    """The TrainingJob's UID in a pod (the operator sets it); None for a local run."""
    return TrainerEnv.from_env(os.environ).run_id


def place_run(checkpoints: CheckpointSpec, namespace: str, job: str, run_id: str | None) -> RunPlace:
    """Choose this run's version and its starting checkpoint (main process only; reads only)."""
    job_uri = layout.job_root(checkpoints.uri, namespace, job)
    choice = runs.look_up_version(open_tree(job_uri), run_id)
    run_uri = layout.join(job_uri, layout.version_name(choice.version))
    start_from = newest_intact(run_uri) if choice.continuing else None
    if start_from is None and checkpoints.resume_from == "latest":
        for version in choice.earlier:
            start_from = newest_intact(layout.join(job_uri, layout.version_name(version)))
            if start_from is not None:
                break
    elif start_from is None and checkpoints.resume_from is not None:
        start_from = checkpoints.resume_from.rstrip("/")
        _, problem = fetch_intact(start_from)
        if problem:
            raise ConfigError(f"spec.checkpoints.resumeFrom: {start_from} cannot be resumed: {problem}; "
                              "name a complete checkpoint (`kubetune checkpoints ls JOB` lists them) or use latest")
    if start_from is not None:  # intact by its manifest; is what resuming reads there and whole?
        from kubetune_trainer.checkpoint.sharded import refuse_damaged

        refuse_damaged(local_path_for(start_from), start_from)
    return RunPlace(choice.version, run_uri, start_from, job_uri, choice)


def claim_run(place: RunPlace, run_id: str | None, job: TrainingJob) -> None:
    """The run's first writes: abandoned versions go, run.json names this run, job.yaml records the
    TrainingJob it trains (main process only)."""
    runs.claim_version(open_tree(place.job_uri), place.choice, run_id, job_manifest_text(job))


def job_manifest_text(job: TrainingJob) -> str:
    """The TrainingJob as YAML one could apply again (the trainer's config has the same form)."""
    return yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False)


def local_start_checkpoint(place: RunPlace, fetch: bool) -> Path | None:
    """The starting checkpoint on this node's disk. `fetch`: this process brings it there (the
    first process of a node other than the main one's, which fetched it while placing the run)."""
    if place.start_from is None:
        return None
    if fetch:
        _, problem = fetch_intact(place.start_from)
        if problem:
            raise RuntimeError(f"{place.start_from} changed while the run started: {problem}")
    return local_path_for(place.start_from)
