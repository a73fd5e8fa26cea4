"""Run versions: every run of a job gets <uri>/<namespace>/<job>/v<N> of its own.

A run is identified by KUBETUNE_RUN_ID, which the operator sets to the TrainingJob's UID: a pod
restarted after preemption finds its own version again and continues it, while the same job
deleted and applied again (a new UID) gets the next version and never overwrites the old one.
Runs started without an id (`kubetune train` on a laptop) get a new version every time.

Each version holds run.json, rewritten as the run goes (start, step MIN_STEPS, each checkpoint,
the end). A run that stopped before MIN_STEPS steps without finishing left nothing worth
keeping — a typo in the manifest, a crash while loading — and the next run of the job deletes it.
Version numbers are never reused, so even a wrongly judged run is never written into. This
assumes one live run per job at a time, which Kubernetes gives (one TrainingJob per
namespace/name); two local `kubetune train` of the same job at once could delete the younger.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from kubetune_api import layout

log = logging.getLogger(__name__)
MIN_STEPS = 5


@dataclass(frozen=True)
class RunRecord:
    """What run.json says about one version; `readable` False when it is missing or damaged."""

    version: int
    run_id: str | None = None
    steps: int = 0
    finished: bool = False
    readable: bool = True

    @property
    def abandoned(self) -> bool:
        """Positively known to have stopped early: a version whose record cannot be read is kept
        (it may hold intact checkpoints; deleting on a guess would lose them)."""
        return self.readable and not self.finished and self.steps < MIN_STEPS


@dataclass(frozen=True)
class VersionChoice:
    version: int
    continuing: bool  # the same run restarted: its own checkpoints come first
    abandoned: tuple[int, ...]  # versions to delete
    earlier: tuple[int, ...]  # versions kept from earlier runs, newest first (resumeFrom: latest)


def choose_version(runs: list[RunRecord], run_id: str | None) -> VersionChoice:
    """Which version this run writes to, and which earlier versions go (pure)."""
    mine = next((r for r in runs if run_id and r.run_id == run_id), None)
    abandoned = tuple(sorted(r.version for r in runs if r.abandoned and r is not mine))
    earlier = tuple(sorted((r.version for r in runs if r is not mine and r.version not in abandoned), reverse=True))
    if mine is not None:
        return VersionChoice(mine.version, True, abandoned, earlier)
    version = max((r.version for r in runs), default=-1) + 1
    return VersionChoice(version, False, abandoned, earlier)


def parse_record(version: int, text: str | None) -> RunRecord:
    """run.json's record; an unreadable one (missing, not JSON, wrong types) says so instead of failing."""
    try:
        data = json.loads(text)
        run_id, steps, finished = data.get("runId"), data.get("steps", 0), data.get("finished", False)
        if (run_id is None or isinstance(run_id, str)) and type(steps) is int and isinstance(finished, bool):
            return RunRecord(version, run_id, steps, finished)
    except (TypeError, ValueError, AttributeError):  # None, not JSON, not an object
        pass
    return RunRecord(version, readable=False)


def read_runs(job_tree) -> list[RunRecord]:
    """Every v<N> under a job's directory (a LocalTree or S3Tree), with its run.json."""
    runs = []
    for name in job_tree.children():
        version = layout.parse_version(name)
        if version is not None:
            runs.append(parse_record(version, job_tree.child(name).read_text(layout.RUN_FILE)))
    return sorted(runs, key=lambda r: r.version)


def look_up_version(job_tree, run_id: str | None) -> VersionChoice:
    """Which version this run takes, from what is there (reads only)."""
    found = read_runs(job_tree)
    for record in found:
        if not record.readable:
            log.warning("%s has no readable %s: kept, and never written into (delete it yourself if it is junk)",
                        job_tree.child(layout.version_name(record.version)).uri, layout.RUN_FILE)
    return choose_version(found, run_id)


def claim_version(job_tree, choice: VersionChoice, run_id: str | None, job_manifest: str) -> None:
    """Delete the abandoned versions, make sure run.json names this run, and record the TrainingJob
    it trains (job.yaml, rewritten by a continuing run: it is what this run's weights came from)."""
    for version in choice.abandoned:
        log.info("deleting %s: its run stopped before %d steps", job_tree.child(layout.version_name(version)).uri,
                 MIN_STEPS)
        job_tree.child(layout.version_name(version)).delete()
    run_tree = job_tree.child(layout.version_name(choice.version))
    if not choice.continuing:
        run_tree.write_text(layout.RUN_FILE, run_record_text(run_id, steps=0, finished=False))
    run_tree.write_text(layout.JOB_FILE, job_manifest)


def run_record_text(run_id: str | None, steps: int, finished: bool) -> str:
    return json.dumps({"runId": run_id, "steps": steps, "finished": finished, "updatedAt": time.time()}, indent=1)
