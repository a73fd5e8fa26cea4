"""`kubetune train --debug`: what it changes in a job (pure)."""
from __future__ import annotations

from pathlib import Path

from kubetune_api.manifest import apply_overrides, parse_manifest
from kubetune_cli.debug import DEBUG_STEPS, debug_overrides


def test_a_debug_run_is_short_validates_little_and_writes_locally(example_manifest):
    example_manifest["spec"]["training"].pop("maxSteps", None)
    example_manifest["spec"]["training"]["epochs"] = 10
    example_manifest["spec"]["checkpoints"]["uri"] = "s3://team-bucket/runs"
    example_manifest["spec"]["validation"] = {"everySteps": 500, "prompts": ["a red cube", "a blue ball"],
                                              "numSamples": 4}
    job = parse_manifest(example_manifest)
    overrides = debug_overrides(job, Path("/work/kubetune-debug"))
    debug = parse_manifest(apply_overrides(example_manifest, overrides))
    assert (debug.spec.training.max_steps, debug.spec.training.epochs) == (DEBUG_STEPS, None)
    assert debug.spec.checkpoints.every_steps == DEBUG_STEPS
    assert debug.spec.checkpoints.uri == "/work/kubetune-debug", "nothing is uploaded"
    validation = debug.spec.validation
    assert (validation.every_steps, validation.num_samples, validation.num_inference_steps, validation.prompts) == (
        DEBUG_STEPS, 1, 2, ["a red cube"])


def test_a_local_job_keeps_its_directory_and_a_shorter_length(example_manifest):
    example_manifest["spec"]["training"]["maxSteps"] = 2
    example_manifest["spec"]["checkpoints"]["uri"] = "/data/runs"
    job = parse_manifest(example_manifest)
    debug = parse_manifest(apply_overrides(example_manifest, debug_overrides(job, Path("/elsewhere"))))
    assert debug.spec.training.max_steps == 2 and debug.spec.checkpoints.uri == "/data/runs"
    assert debug.spec.validation.every_steps is None, "a job that does not validate is not made to"
