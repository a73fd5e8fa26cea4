"""The models stage: a job's hub models pinned to commits (recorded in the run) and placed where the
trainers read them — the S3 mirror (spec.model.mirrorUri, else the chart's models.mirrorUri), or
this machine's hub cache without one.

`python -m kubetune_trainer.models.hub_stage --config JOB.yaml` is what the pod's entry point runs before
any trainer: the only process that gets the hub token (contract.HUB_TOKEN_ENV). It writes where each
model lies to placements_file(), which the trainers of the pod read (kubetune_trainer.run). A local
`kubetune train` has no such stage: its trainer places the models itself (hub_locations), with the
token the user's environment gives huggingface_hub (HF_TOKEN).

The pins: a branch moves, so the first start of a run resolves every revision to a commit and
records it at <checkpoints>/<namespace>/<job>/hub-revisions/<run id>.json, created only if absent
(first writer wins); every node and every restart of the run reads the record, never the branch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kubetune_api import layout
from kubetune_api.contract import HUB_TOKEN_ENV, MODELS_MIRROR_ENV, TrainerEnv
from kubetune_api.hub import HubInput, hub_inputs
from kubetune_trainer.checkpoint.resume import run_id_from_env
from kubetune_trainer.process.exit_answer import exit_answer
from kubetune_trainer.storage import hub, s3
from kubetune_trainer.storage.inputs import cache_root
from kubetune_trainer.storage.uri import is_s3, parse_s3

LOCAL_TOKEN_HINT = "set HF_TOKEN to a token with access to it (spec.model.hubTokenSecret is read on the cluster)"


def job_hub_inputs(job) -> list[HubInput]:
    """The job's hub models; a bare relative path that exists here is a local folder, not a hub id."""
    return [item for item in hub_inputs(job.spec) if not Path(item.repo_id).exists()]


def namespace_of(job) -> str:
    return TrainerEnv.from_env(os.environ).namespace or job.metadata.namespace or "default"


def record_uri(job, run_id: str | None) -> str | None:
    """Where the run's pins are recorded; None for a run without an id (each local run is its own)."""
    if not run_id:
        return None
    root = layout.job_root(job.spec.checkpoints.uri, namespace_of(job), job.metadata.name)
    return layout.join(root, "hub-revisions", f"{run_id}.json")


def _read(uri: str) -> str | None:
    if is_s3(uri):
        return s3.read_text(parse_s3(uri))
    path = Path(uri).expanduser()
    return path.read_text() if path.is_file() else None


def _write_if_absent(uri: str, text: str) -> None:
    if is_s3(uri):
        s3.write_text_if_absent(parse_s3(uri), text)
        return
    path = Path(uri).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "x") as out:  # O_EXCL: never through a link, never over another writer's record
            out.write(text)
    except FileExistsError:
        pass


def pinned_commits(items: list[HubInput], record: str | None, token: str | None, token_hint: str) -> dict[str, str]:
    """field -> commit: the run's record where it names the same (model, revision), else the hub's answer now."""
    def recorded() -> dict:
        text = record and _read(record)
        return json.loads(text) if text else {}

    def matching(entries: dict) -> dict[str, str]:
        return {i.field: entries[i.field]["commit"] for i in items if i.field in entries
                and (entries[i.field].get("repo"), entries[i.field].get("revision")) == (i.repo_id, i.revision)}

    pins = matching(recorded())
    if len(pins) == len(items):
        return pins
    resolved = {i.field: {"repo": i.repo_id, "revision": i.revision,
                          "commit": pins.get(i.field) or hub.resolve_commit(i, token, token_hint)} for i in items}
    if record is None:
        return {field: entry["commit"] for field, entry in resolved.items()}
    _write_if_absent(record, json.dumps(resolved, indent=1, sort_keys=True))
    pins = matching(recorded())  # whoever wrote first decides for the whole run
    return {i.field: pins.get(i.field) or resolved[i.field]["commit"] for i in items}


def place_hub_models(job, token: str | None, token_hint: str) -> dict[str, str]:
    """field -> where the trainers read the model: its s3:// mirror, or a local snapshot folder."""
    items = job_hub_inputs(job)
    if not items:
        return {}
    commits = pinned_commits(items, record_uri(job, run_id_from_env()), token, token_hint)
    mirror = job.spec.model.mirror_uri or os.environ.get(MODELS_MIRROR_ENV) or None
    staging = cache_root() / "hub-staging"
    placed = {}
    for item in items:
        commit = commits[item.field]
        placed[item.field] = (hub.mirror(item, commit, mirror, token, staging, token_hint) if mirror
                              else hub.download_local(item, commit, token, token_hint))
    return placed


def placements_file(run_id: str | None) -> Path | None:
    return cache_root() / "hub" / f"{run_id}.json" if run_id else None


def hub_locations(job) -> dict[str, str]:
    """For a trainer: where the models stage placed the job's hub models (in a pod), or placed now
    (a local run, or a pod whose stage did not run)."""
    if not job_hub_inputs(job):
        return {}
    placements = placements_file(run_id_from_env())
    if placements is not None and placements.is_file():
        return json.loads(placements.read_text())
    return place_hub_models(job, token=None, token_hint=LOCAL_TOKEN_HINT)


def main(argv: list[str] | None = None) -> int:
    import logging

    parser = argparse.ArgumentParser(prog="python -m kubetune_trainer.models.hub_stage", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kubetune_api.manifest import load_manifest

    job = load_manifest(args.config)
    try:
        placed = place_hub_models(job, token=os.environ.get(HUB_TOKEN_ENV) or None, token_hint=hub.JOB_TOKEN_HINT)
    except Exception as err:
        found = exit_answer(err)  # the trainer's answer to the same error (2 the spec, 143 retry, 1 the store)
        if found is None:
            raise  # a bug: its traceback is what a report needs
        print(f"kubetune models: {found.message}", file=sys.stderr)
        return found.code
    placements = placements_file(run_id_from_env())
    if placements is not None:
        placements.parent.mkdir(parents=True, exist_ok=True)
        partial = placements.with_name(placements.name + ".part")
        partial.write_text(json.dumps(placed))
        partial.replace(placements)
    for field, where in placed.items():
        print(f"kubetune models: {field} -> {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
