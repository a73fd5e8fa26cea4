"""Everything the report shows about one run, gathered from a local copy of the run's records.

Where it comes from: the run's TensorBoard events (logs/), its validation grids
(samples/step-NNNNNNN/grid.png), the TrainingJob it trained (job.yaml), and what storage says about it
(kubetune_trainer.checkpoint.catalog: run.json, the checkpoint manifests, the final weights). Anything
absent is noted in `missing`, so a run without logs still gets a page that says what it lacks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import yaml

from kubetune_api import layout
from kubetune_trainer.results.run_report.events import Point, Scalars, read_scalars
from kubetune_trainer.checkpoint.catalog import RunEntry

LOGS, SAMPLES, BEST = "logs", "samples", "best"
GRID_FILE = "grid.png"
_SAMPLE_STEP = re.compile(r"^step-(\d+)$")
_BEST_STEP = re.compile(r"^best/step-(\d+)/")


@dataclass(frozen=True)
class Grid:
    step: int
    name: str  # its path in the run: samples/step-0000100/grid.png
    path: Path  # the local copy


@dataclass(frozen=True)
class Timing:
    first_step: int
    last_step: int
    started: float  # wall time the first logged step ended
    ended: float  # wall time the last logged step ended
    samples_per_second: float | None  # the median of the steps' rates

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def steps_per_second(self) -> float | None:
        return (self.last_step - self.first_step) / self.seconds if self.seconds > 0 else None


@dataclass
class RunFacts:
    run: RunEntry
    job_text: str | None
    job: dict
    scalars: Scalars
    grids: list[Grid]
    best: dict[int, list[str]]  # spec.validation.keepBest: step -> its files under best/
    missing: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return (self.job.get("metadata") or {}).get("name") or self.run.uri.rstrip("/").rsplit("/", 1)[-1]

    @property
    def prompts(self) -> list[str]:
        return list(((self.job.get("spec") or {}).get("validation") or {}).get("prompts") or [])

    @property
    def loss(self) -> list[Point]:
        return self.scalars.get("train/loss")

    @property
    def lr(self) -> list[Point]:
        return self.scalars.get("train/lr")

    @property
    def validation(self) -> dict[str, list[Point]]:
        return self.scalars.under("validation/")

    @property
    def timing(self) -> Timing | None:
        if len(self.loss) < 1:
            return None
        rates = [p.value for p in self.scalars.get("train/samples_per_second") if p.value > 0]
        first, last = self.loss[0], self.loss[-1]
        return Timing(first.step, last.step, first.wall_time, last.wall_time, median(rates) if rates else None)


def grids_in(samples: Path) -> list[Grid]:
    """The validation grids by step, step 0 (the base model, before any training) first."""
    found = []
    for folder in samples.iterdir() if samples.is_dir() else []:
        match = _SAMPLE_STEP.match(folder.name)
        if match and (folder / GRID_FILE).is_file():
            found.append(Grid(int(match.group(1)), f"{SAMPLES}/{folder.name}/{GRID_FILE}", folder / GRID_FILE))
    return sorted(found, key=lambda grid: grid.step)


def best_in(files: dict[str, int]) -> dict[int, list[str]]:
    best: dict[int, list[str]] = {}
    for name in sorted(files):
        match = _BEST_STEP.match(name)
        if match:
            best.setdefault(int(match.group(1)), []).append(name)
    return best


def parsed_job(text: str | None) -> dict:
    """job.yaml as plain data; a job a newer or older spec would refuse still shows (it is only read)."""
    try:
        job = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return {}
    return job if isinstance(job, dict) else {}


def gather(run: RunEntry, local: Path, files: dict[str, int]) -> RunFacts:
    """RUN as storage describes it; LOCAL holds copies of its logs/, samples/ and job.yaml; FILES lists
    every file of the run (relative names and sizes)."""
    job_path = local / layout.JOB_FILE
    job_text = job_path.read_text() if job_path.is_file() else None
    facts = RunFacts(run, job_text, parsed_job(job_text), read_scalars(local / LOGS), grids_in(local / SAMPLES),
                     best_in(files))
    if job_text is None:
        facts.missing.append(f"no {layout.JOB_FILE}: the run was written by a kubetune that did not record "
                             "its TrainingJob, so the spec cannot be shown")
    if not facts.scalars.files:
        facts.missing.append(f"no TensorBoard event files under {LOGS}/: no loss or learning-rate curves, "
                             "no validation metrics and no timing (the run logged nothing yet, or its logs were removed)")
    elif not facts.loss:
        facts.missing.append(f"no train/loss in the event files under {LOGS}/: no loss curve and no timing")
    if not facts.grids:
        facts.missing.append(f"no validation grids ({SAMPLES}/step-NNNNNNN/{GRID_FILE}): set "
                             "spec.validation.everySteps with prompts (or held-out data) to sample images")
    if not run.final_files:
        facts.missing.append("no final weights: the run has not finished" if not run.record.finished
                             else "no final weights at the run's root")
    return facts
