"""`kubetune train --debug`: the job cut down to a quick check of its whole path.

A few steps with a checkpoint at the last one, a tiny validation (one sample, two denoising steps,
the first prompt) when the job validates, autograd anomaly detection in the trainer (a NaN or inf
names the operation that made it), and nothing uploaded: a job whose checkpoints go to s3://
writes them, its logs and its weights under a local directory instead, and nothing is logged to
MLflow (spec.tracking.mlflow is dropped). Reading s3:// data and
models still works. Pure functions of the job, so what --debug changes is unit-tested.
"""
from __future__ import annotations

import json
from pathlib import Path

from kubetune_api.spec import TrainingJob

DEBUG_STEPS = 3
# The trainer's flag for autograd anomaly detection (kubetune_trainer.__main__).
ANOMALY_FLAG = "--detect-anomaly"


def debug_overrides(job: TrainingJob, local_dir: Path) -> list[str]:
    """The --set overrides that turn JOB into its debug run (writing under LOCAL_DIR instead of S3)."""
    spec = job.spec
    steps = min(spec.training.max_steps or DEBUG_STEPS, DEBUG_STEPS)
    overrides = [f"spec.training.maxSteps={steps}", "spec.training.epochs=null",
                 f"spec.checkpoints.everySteps={steps}"]
    if spec.validation.every_steps:
        overrides += [f"spec.validation.everySteps={steps}", "spec.validation.numSamples=1",
                      "spec.validation.numInferenceSteps=2",
                      f"spec.validation.prompts={json.dumps(spec.validation.prompts[:1])}"]
    if spec.checkpoints.uri.startswith("s3://"):
        overrides.append(f"spec.checkpoints.uri={local_dir}")
    if spec.tracking.mlflow is not None:
        overrides.append("spec.tracking.mlflow=null")
    return overrides
