"""The operator <-> trainer contract: everything one side writes and the other side reads.

The operator (kubetune_operator) renders a pod; the trainer (kubetune_trainer) runs in it. What
passes between them is named here and nowhere else:

  * the API: group, version, kind and plural of the TrainingJob resource;
  * the trainer config: a ConfigMap key mounted at a fixed path, and the commands that read it;
  * the environment the operator sets for the trainer, as one typed object (TrainerEnv), and the
    environment the Kubeflow controller sets for the node launcher (NodeEnv, PyTorchJob and
    TrainJob alike);
  * the Prometheus gauges the trainer serves and the operator reads back into status.progress
    and status.validation, and the same gauges as rank 0 leaves them in its termination message;
  * the trainer's exit codes, which the backends' restart policies read;
  * the log lines a local sweep (kubetune_cli.sweep) reads its trials' progress from: each line's
    format (the trainer writes it) beside its pattern (the CLI parses it);
  * the backends a job may run on (spec.backend, the operator's backends, the chart's values).

tests/unit/test_contract.py greps the packages for these values written out anywhere else.

Torch-free and kopf-free, like the rest of kubetune_api: both sides import it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from typing import Mapping

from kubetune_api.families import FAMILIES

# ---- the API --------------------------------------------------------------------------------------

API_GROUP = "kubetune.dev"
API_VERSION = "v1alpha1"
API_GROUP_VERSION = f"{API_GROUP}/{API_VERSION}"  # a manifest's apiVersion
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SHORT_NAMES = ("tj",)
SWEEP_KIND = "TrainingSweep"
SWEEP_PLURAL = "trainingsweeps"
SWEEP_SHORT_NAMES = ("tsw",)
# On each trial's TrainingJob: the sweep it belongs to, its number, its parameter values (JSON) and,
# for a PBT trial that copied a stronger one, that trial's number, so that the sweep's record can be
# rebuilt from the trials themselves.
SWEEP_LABEL = "kubetune.dev/sweep"
TRIAL_LABEL = "kubetune.dev/trial"
TRIAL_PARAMETERS_ANNOTATION = "kubetune.dev/trial-parameters"
TRIAL_EXPLOITED_FROM_ANNOTATION = "kubetune.dev/trial-exploited-from"
# Set by the operator on a trial's TrainingJob once the sweep announced its end in an event
# (succeeded, failed, stopped): the sweep's status may be written after that, or lost with a restart,
# and the event is then not announced twice.
TRIAL_REPORTED_ANNOTATION = "kubetune.dev/trial-reported"

# ---- the trainer config and the commands that read it -------------------------------------------

CONFIG_MOUNT = "/etc/kubetune"
CONFIG_KEY = "trainingjob.yaml"
CONFIG_PATH = f"{CONFIG_MOUNT}/{CONFIG_KEY}"
# The trainer pod's writable cache (HOME, the hub cache, staged inputs): an emptyDir.
CACHE_DIR = "/var/cache/kubetune"
# Where the trainer pod keeps its own volumes, and why: a volume of the job (spec.volumes) mounted
# at one of them, or over one (a parent), would hide what the trainer needs there.
TRAINER_OWN_PATHS = {
    CONFIG_MOUNT: "the job's config",
    CACHE_DIR: "the trainer's cache",
    "/tmp": "the trainer's scratch space",
    "/dev/shm": "the data loaders' shared memory",
}
# The pod's main process: the node launcher (one trainer per GPU, or per processesPerNode on CPU).
TRAINER_COMMAND = ("python", "-m", "kubetune_trainer.pod")
TRAINER_ARGS = ("--config", CONFIG_PATH)
# The cache stage: one process encodes every sample once before any node trains. Either its own
# container (an init container of rank 0's pod), or the entry point's flag CACHE_STAGE_FIRST, which
# runs it on node 0 before the node's trainers start (where all nodes share one pod template).
CACHE_STAGE_COMMAND = ("python", "-m", "kubetune_trainer")
CACHE_STAGE_ARGS = ("--config", CONFIG_PATH, "--cache-only")
CACHE_STAGE_FIRST = "--cache-stage"
# Hub models (kubetune_api.hub): the entry point runs the models stage (`python -m
# kubetune_trainer.models.hub_stage`) before any trainer, the only process given the hub token, which
# reaches the pod under HUB_TOKEN_ENV from key HUB_TOKEN_KEY of spec.model.hubTokenSecret; the
# entry point takes it out of the environment its trainers inherit. MODELS_MIRROR_ENV is the
# chart's models.mirrorUri (spec.model.mirrorUri overrides it).
HUB_TOKEN_ENV = "KUBETUNE_HUB_TOKEN"
HUB_TOKEN_KEY = "HF_TOKEN"
MODELS_MIRROR_ENV = "KUBETUNE_MODELS_MIRROR"
MODELS_STAGE_COMMAND = ("python", "-m", "kubetune_trainer.models.hub_stage")
MODELS_STAGE_ARGS = ("--config", CONFIG_PATH)

# ---- the trainer's exit codes ------------------------------------------------------------------

# The exit code of a trainer stopped by SIGTERM after its last checkpoint (128 + SIGTERM): retryable,
# never a failure.
EXIT_PREEMPTED = 143
# The job itself is wrong (a bad spec, data or model): retrying cannot help.
EXIT_BAD_INPUT = 2
# The loss became inf/NaN: a retry would diverge again at the same step.
EXIT_DIVERGED = 3

# ---- the backends ---------------------------------------------------------------------------------

# The Kubeflow job a TrainingJob runs as: PyTorchJob (Training Operator v1.9) or TrainJob (Trainer v2.3
# with JobSet). spec.backend's values, the operator's backends and the chart's `backend` value.
PYTORCHJOB = "pytorchjob"
TRAINJOB = "trainjob"
BACKENDS = (PYTORCHJOB, TRAINJOB)

# ---- the environment the operator sets --------------------------------------------------------------

# The pod's own address and name, from the downward API (status.podIP, metadata.name);
# KUBETUNE_METRICS_ADDR and KUBETUNE_POD_NAME refer to them as $(POD_IP) and $(POD_NAME).
POD_IP = "POD_IP"
POD_NAME = "POD_NAME"
# The trainer container's CPU request and limit in millicores, from the downward API
# (resourceFieldRef, divisor 1m): the trainer sizes its CPU threads per process from them.
CPU_REQUEST_MILLICORES = "KUBETUNE_CPU_REQUEST_MILLICORES"
CPU_LIMIT_MILLICORES = "KUBETUNE_CPU_LIMIT_MILLICORES"


@dataclass(frozen=True)
class TrainerEnv:
    """What the operator tells every trainer pod through its environment (None = not set).

    `to_env()` renders the pod's env entries (the operator), `from_env()` reads them back (the
    trainer). Credentials are not here: they reach the pod as secretKeyRef entries (AWS_*), and the
    S3 endpoint and region under the AWS SDK's own names, which the trainer leaves to boto3.
    """

    job_name: str | None = None          # the TrainingJob's name (informational: the trainer reads its config's)
    namespace: str | None = None         # its namespace
    run_id: str | None = None            # its UID: a restarted pod continues its run's version
    metrics_port: int | None = None      # rank 0 serves Prometheus metrics here; None = no server
    metrics_addr: str | None = None      # the address that server binds (the pod's own)
    cache_dir: str | None = None         # where s3:// inputs are mirrored
    staging_dir: str | None = None       # where checkpoints are staged before the upload
    s3_path_style: bool | None = None    # path-style S3 addressing (MinIO and friends)
    # The pod's name, which the trainer reports in kubetune_trainer_pod_info for joins with GPU
    # exporters' pod label: a JobSet pod's hostname is not its name (<job>-<index> vs <job>-<index>-<suffix>).
    pod_name: str | None = None
    # Seconds rank 0 waits, after its last step, for the operator to read its final metrics (a run
    # ending between two progress polls would otherwise take its last step, loss and validation with it).
    final_read_seconds: float | None = None
    # Where rank 0 pushes its progress (the operator's progress inbox: POST <progress_url>
    # PROGRESS_PATH/<namespace>/<job>, the final_report JSON), and how often; None = no push (the
    # operator reads /metrics instead).
    progress_url: str | None = None
    progress_interval_seconds: float | None = None

    # Field -> variable; the names are the contract, so they never change lightly.
    NAMES = {
        "job_name": "KUBETUNE_JOB_NAME",
        "namespace": "KUBETUNE_NAMESPACE",
        "run_id": "KUBETUNE_RUN_ID",
        "metrics_port": "KUBETUNE_METRICS_PORT",
        "metrics_addr": "KUBETUNE_METRICS_ADDR",
        "cache_dir": "KUBETUNE_CACHE_DIR",
        "staging_dir": "KUBETUNE_STAGING_DIR",
        "s3_path_style": "KUBETUNE_S3_PATH_STYLE",
        "pod_name": "KUBETUNE_POD_NAME",
        "final_read_seconds": "KUBETUNE_FINAL_READ_SECONDS",
        "progress_url": "KUBETUNE_PROGRESS_URL",
        "progress_interval_seconds": "KUBETUNE_PROGRESS_INTERVAL_SECONDS",
    }
    # Set for people and log collectors looking at a pod; the trainer itself does not need them.
    INFORMATIONAL = ("job_name",)

    def to_env(self) -> list[dict]:
        """The set fields as pod env entries, in field order (so `$(POD_IP)` can refer to POD_IP above them)."""
        entries = []
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            text = str(value).lower() if isinstance(value, bool) else str(value)
            entries.append({"name": self.NAMES[field.name], "value": text})
        return entries

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "TrainerEnv":
        """The object back from a process environment; empty variables count as unset."""
        raw = {field: env.get(name) or None for field, name in cls.NAMES.items()}
        port, final_read, interval = raw["metrics_port"], raw["final_read_seconds"], raw["progress_interval_seconds"]
        path_style = {"true": True, "1": True, "false": False, "0": False}.get((raw["s3_path_style"] or "").lower())
        return cls(**{**raw, "metrics_port": int(port) if port else None, "s3_path_style": path_style,
                      "final_read_seconds": float(final_read) if final_read else None,
                      "progress_interval_seconds": float(interval) if interval else None})


# ---- the environment the Kubeflow controller sets ----------------------------------------------

@dataclass(frozen=True)
class NodeEnv:
    """Where a pod stands in a distributed job, from what the Kubeflow controller injects.

    Training Operator v1 (PyTorchJob) and Trainer v2 (TrainJob, torch plugin) both set PET_NNODES,
    PET_NODE_RANK and PET_NPROC_PER_NODE; the rendezvous address is MASTER_ADDR/MASTER_PORT in v1
    and PET_MASTER_ADDR/PET_MASTER_PORT in v2, so the PET_ names win where both are present.
    """

    processes: int = 1
    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    NNODES = "PET_NNODES"
    NODE_RANK = "PET_NODE_RANK"
    NPROC_PER_NODE = "PET_NPROC_PER_NODE"
    MASTER_ADDR = ("PET_MASTER_ADDR", "MASTER_ADDR")
    MASTER_PORT = ("PET_MASTER_PORT", "MASTER_PORT")
    # Set by the controllers themselves; a job's own env must not name them (Trainer v2 refuses it).
    RESERVED = ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "NodeEnv":
        def first(names: tuple[str, ...], default: str) -> str:
            return next((env[name] for name in names if env.get(name)), default)

        processes = first((cls.NPROC_PER_NODE,), "1")  # "auto" (a v2 default we never send) counts as 1
        return cls(
            processes=int(processes) if processes.isdigit() else 1,
            nodes=int(first((cls.NNODES,), "1").split(":")[-1]),  # "2", or an elastic "1:2"
            node_rank=int(first((cls.NODE_RANK, "RANK"), "0")),
            master_addr=first(cls.MASTER_ADDR, "127.0.0.1"),
            master_port=int(first(cls.MASTER_PORT, "29500")),
        )


# ---- the metrics the operator reads back ----------------------------------------------------------

TRAINER_METRIC_PREFIX = "kubetune_trainer"
# The operator's progress reads ask for /metrics?<this>: the trainer tells them from Prometheus' scrapes
# (TrainerEnv.final_read_seconds waits for one of the operator's).
OPERATOR_READ_QUERY = "reader=kubetune-operator"


# The trainer's last reading, kept after its pod is gone. A run that ends between two reads (a sweep
# trial shorter than the operator's interval, or an operator busy with a thousand jobs) would take its
# final step, loss and validation with it. Kubernetes keeps what a container wrote to its
# terminationMessagePath (this is the default path; at most 4096 bytes) in the pod's status after it
# exits, so rank 0 writes its final gauges there as JSON and the operator reads them once the child
# finished. The gauges only (a dozen numbers, well under the limit), under one key so that any other
# text a container leaves there is never taken for a report.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
FINAL_REPORT_KEY = "kubetuneFinalGauges"


def final_report(gauges: Mapping[str, float]) -> str:
    """The termination message carrying GAUGES (names without TRAINER_METRIC_PREFIX); a value JSON
    cannot carry (NaN, infinite) is left out."""
    finite = {name: float(value) for name, value in sorted(gauges.items()) if math.isfinite(value)}
    return json.dumps({FINAL_REPORT_KEY: finite}, separators=(",", ":"))


# The operator's progress inbox (kubetune_operator.progress_inbox): rank 0 POSTs final_report's JSON
# to <TrainerEnv.progress_url>/progress/<namespace>/<job> once per interval, so that the operator
# needs no GET per running job per interval (benchmarks/RESULTS.md, "Progress at 1,000 running jobs").
PROGRESS_PATH = "/progress"


def progress_path(namespace: str, job: str) -> str:
    """The inbox's path for one TrainingJob's pushes."""
    return f"{PROGRESS_PATH}/{namespace}/{job}"


def read_final_report(message: str | None) -> dict[str, float] | None:
    """The gauges in a termination message written by final_report; None for any other message."""
    try:
        found = json.loads(message or "")
    except ValueError:
        return None
    gauges = found.get(FINAL_REPORT_KEY) if isinstance(found, dict) else None
    if not isinstance(gauges, dict):
        return None
    return {str(name): float(value) for name, value in gauges.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


# Every metric a validation may report: each family's, plus the CLIP image metrics a sweep's objective
# may already name (kubetune_api.sweep). A closed set, so the trainer serves a bounded number of gauges.
CLIP_METRICS = ("clip_score", "clip_directional")
VALIDATION_METRICS = tuple(sorted({m for family in FAMILIES.values() for m in family.metrics} | set(CLIP_METRICS)))


RECENT_LOSS_STEPS = 5  # steps in TrainerGauge.RECENT_LOSS's mean (and in the local sweep's, from the log)


class TrainerGauge:
    """Names (without TRAINER_METRIC_PREFIX) of the rank-0 gauges behind status.progress, status.outputUri
    and status.validation."""

    STEP = "step"
    PLANNED_STEPS = "planned_steps"
    LOSS = "loss"
    # The mean loss of the latest RECENT_LOSS_STEPS steps: what a sweep's training-loss objective
    # reads (status.progress.recentLoss). One step's loss is noise; polls every few seconds catch
    # whichever steps they happen to, so a trial's value must not depend on which ones they were.
    RECENT_LOSS = "recent_loss"
    ETA_SECONDS = "eta_seconds"
    RUN_VERSION = "run_version"
    LAST_CHECKPOINT_STEP = "last_checkpoint_step"
    # Unix seconds: when the newest complete checkpoint was written (absent or 0 for the one a resumed
    # run started from, written by an earlier attempt), and since when this process's work is unsaved
    # (the moment the newest checkpoint's state was taken, or training began): status.lastCheckpoint
    # and status.unsavedWork, the work a preemption would cost (Kueue's priority boost).
    LAST_CHECKPOINT_TIME = "last_checkpoint_time_seconds"
    UNSAVED_SINCE = "unsaved_since_seconds"

    # The latest validation: its step, and each metric as a gauge of its own (validation_loss, ...).
    # A name per metric, not a label: the operator's reader keys samples by name and drops labels.
    VALIDATION_STEP = "validation_step"

    ALL = (STEP, PLANNED_STEPS, LOSS, RECENT_LOSS, ETA_SECONDS, RUN_VERSION, LAST_CHECKPOINT_STEP, LAST_CHECKPOINT_TIME,
           UNSAVED_SINCE, VALIDATION_STEP)

    @staticmethod
    def validation(metric: str) -> str:
        """The gauge of one VALIDATION_METRICS entry."""
        return f"validation_{metric}"

    @staticmethod
    def full_name(name: str) -> str:
        return f"{TRAINER_METRIC_PREFIX}_{name}"


# ---- the log lines a local sweep reads --------------------------------------------------------------

class TrainerLog:
    """The trainer's log lines that `kubetune sweep` (run locally) reads its trials' progress from.

    Each line's format (for the logging call, %-style) sits beside the pattern that parses it, so a
    change to one is a change to the other; tests/unit/test_contract.py checks they round-trip.
    """

    # Every `log_every` steps (kubetune_trainer.telemetry.reporting): step, planned steps, loss, lr, throughput.
    STEP = "step %d/%d loss %.5f lr %.3e %.2f samples/s"
    STEP_PATTERN = re.compile(r"\bstep (\d+)/\d+ loss ([-+0-9.einfa]+)")
    # After each validation (kubetune_trainer.results.validation): "<metric> <value>" pairs, comma-separated.
    VALIDATION = "validation at step %d: %s"
    VALIDATION_PATTERN = re.compile(r"validation at step (\d+): (.*)$")
    # At the end of a run (kubetune_trainer.run): the written weights' URIs, comma-separated.
    FINAL_WEIGHTS = "final weights: %s"
    FINAL_WEIGHTS_PATTERN = re.compile(r"final weights: (\S+)")

    @staticmethod
    def validation_metrics(metrics: Mapping[str, float]) -> str:
        """VALIDATION's second argument."""
        return ", ".join(f"{name} {value:.5f}" for name, value in metrics.items())

    @classmethod
    def parse_validation(cls, line: str) -> tuple[int, dict[str, float]] | None:
        """(step, metric -> value) of a VALIDATION line; None for any other line."""
        match = cls.VALIDATION_PATTERN.search(line)
        if not match:
            return None
        pairs = (part.rsplit(" ", 1) for part in match.group(2).split(", ") if " " in part)
        return int(match.group(1)), {name: float(value) for name, value in pairs}

    @classmethod
    def parse_steps(cls, text: str) -> list[tuple[int, float]]:
        """(step, loss) of every STEP line in `text`, in order."""
        return [(int(step), float(loss)) for step, loss in cls.STEP_PATTERN.findall(text)]

    @classmethod
    def parse_final_weights(cls, text: str) -> list[str]:
        """The first URI of every FINAL_WEIGHTS line in `text`, in order."""
        return [uri.rstrip(",") for uri in cls.FINAL_WEIGHTS_PATTERN.findall(text)]


# ---- generation on the cluster (`kubetune generate --on-cluster`) ---------------------------------

# The CLI asks the operator for a generation by setting this annotation on the TrainingJob: the JSON of a
# GenerationRequest (kubetune_operator.generation_jobs). One request at a time per job; a new id
# replaces the last. An annotation, not a resource of its own: whoever may edit the TrainingJob may ask
# for images from it, and the request goes when the job goes.
GENERATE_ANNOTATION = f"{API_GROUP}/generate"
# The operator answers in status.generations: one entry per request id it saw, with its phase
# (Running, Succeeded, Failed), the S3 URI of the images, and a message when it failed.
GENERATIONS_STATUS = "generations"
# On the batch Job that draws (and its pod): the request's id.
GENERATION_LABEL = f"{API_GROUP}/generation"
# The pod's command: kubetune_trainer.results.generation_pod draws a run's images into an S3 folder.
GENERATION_COMMAND = ("python", "-m", "kubetune_trainer.results.generation_pod")
# Where the images of a request go, beside the run: <outputUri>/generated/<label>/
GENERATED_FOLDER = "generated"
