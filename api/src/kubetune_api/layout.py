"""Where a job's runs live under spec.checkpoints.uri (pure functions, shared by every side).

    <uri>/<namespace>/<job>/v<N>/               one run: run.json, job.yaml, report.html, final weights, logs
    <uri>/<namespace>/<job>/v<N>/checkpoint-<S>/  one checkpoint, manifest.json written last

Every run of a job gets the next version number, so a job deleted and applied again never
overwrites what an earlier run wrote. The trainer picks the version; the operator and the CLI
only follow what it reports (status.outputUri) or what they list.
"""
from __future__ import annotations

import re

RUN_FILE = "run.json"
# The TrainingJob the run trained (overrides applied), so that what reads a run later (generate,
# export, evaluate, report) needs only its URI. Secrets are never in a spec: only their names.
JOB_FILE = "job.yaml"
# One page to look at (curves, validation grids, the spec, where the weights are), written by the
# trainer when the run ends (`kubetune report` writes it again for any run); status.reportUri names it.
REPORT_FILE = "report.html"
# Files at a run's root that are about the run, not its weights.
RUN_RECORDS = frozenset({RUN_FILE, JOB_FILE, REPORT_FILE})
_VERSION = re.compile(r"^v(\d+)$")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


def job_root(uri: str, namespace: str, job: str) -> str:
    return join(uri, namespace or "default", job)


def run_root(uri: str, namespace: str, job: str, version: int) -> str:
    return join(job_root(uri, namespace, job), version_name(version))


def version_name(version: int) -> str:
    return f"v{version}"


def parse_version(name: str) -> int | None:
    """v3 -> 3; anything else (a stray file, "v", "v1a") -> None."""
    match = _VERSION.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def parse_checkpoint(name: str) -> int | None:
    match = _CHECKPOINT.fullmatch(name)
    return int(match.group(1)) if match else None
