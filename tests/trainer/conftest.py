"""Tiny SD1.5 model and captioned data, built once per test session (no downloads)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import warm_python


@pytest.fixture(scope="session")
def tiny_sd15(tiny_model) -> Path:
    """tiny_model("sd15") (tests/conftest.py): one folder, so that runs trained on either are the same run."""
    return tiny_model("sd15")


@pytest.fixture(scope="session")
def captions_data(tiny_dataset) -> Path:
    """tiny_dataset("captions"), for the same reason."""
    return tiny_dataset("captions")


def tiny_manifest(model: Path, data: Path, out: Path, **training) -> dict:
    """A manifest for a few CPU steps on the tiny SD1.5 model; tests adjust what they need."""
    return {
        "apiVersion": "kubetune.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"family": "sd15", "pretrained": str(model)},
            "adapter": {"type": "lora", "rank": 4, "alpha": 4},
            "data": {"layout": "captions", "uri": str(data), "resolution": 32},
            "training": {"maxSteps": 2, "batchSize": 2, "learningRate": 1e-2, "seed": 3, **training},
            "checkpoints": {"uri": str(out), "everySteps": 2, "keepLast": 10},
            "resources": {"gpusPerNode": 0},
        },
    }


@pytest.fixture
def tiny_job(tiny_sd15, captions_data, tmp_path):
    """tiny_job(**training): tiny_manifest writing under tmp_path/out."""
    return lambda **training: tiny_manifest(tiny_sd15, captions_data, tmp_path / "out", **training)


def write_manifest(manifest: dict, directory: Path) -> Path:
    path = directory / f"{manifest['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def trainer_command(config: Path) -> list[str]:
    """The trainer as a pod runs it, in its own process."""
    return [sys.executable, "-m", "kubetune_trainer", "--config", str(config)]


def trainer_env() -> dict[str, str]:
    # One thread: CPU results are then bitwise reproducible between runs.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_trainer_on(config: Path, env: dict[str, str] | None = None, timeout: float = 600
                   ) -> subprocess.CompletedProcess:
    """`python -m kubetune_trainer --config CONFIG`, its output captured: forked from this worker's
    pre-imported interpreter (tests/warm_python.py) where the environment allows, else a fresh process.
    Tests of how a process starts or stops (signals, a launcher) use subprocess themselves."""
    return warm_python.run(trainer_command(config), env=env or trainer_env(), timeout=timeout)


def run_dir(checkpoints_uri: Path, version: int = 0, job: str = "tiny") -> Path:
    """Where a local run of `job` writes: <checkpoints.uri>/default/<job>/v<N> (kubetune_api.layout)."""
    return checkpoints_uri / "default" / job / f"v{version}"


def run_trainer(manifest: dict, directory: Path) -> subprocess.CompletedProcess:
    result = run_trainer_on(write_manifest(manifest, directory))
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="session")
def sd15_run(tiny_sd15, captions_data, tmp_path_factory) -> tuple[dict, Path]:
    """One finished two-step SD1.5 LoRA run (checkpoint-2, final weights, a quarter of the captions held
    out), trained once per session for every test that reads a finished run: (its manifest, its
    checkpoints.uri). Read-only: a test that changes the run works on copy_of_run's copy."""
    root = tmp_path_factory.mktemp("sd15-run")
    manifest = tiny_manifest(tiny_sd15, captions_data, root / "out")
    manifest["spec"]["validation"] = {"heldOutFraction": 0.25}
    run_trainer(manifest, root)
    return manifest, root / "out"


@pytest.fixture(scope="session")
def sdxl_run(tiny_model, tiny_dataset, tmp_path_factory) -> Path:
    """One finished two-step SDXL LoRA run (random flips, no center crop, half the captions dropped), trained
    once per session for the SDXL family test and `kubetune export`'s: its checkpoints.uri. Read-only."""
    root = tmp_path_factory.mktemp("sdxl-run")
    run_trainer(family_job("sdxl", "captions", tiny_model("sdxl"), tiny_dataset("captions"), root / "out",
                           data={"randomFlip": True, "centerCrop": False, "captionDropout": 0.5}), root)
    return root / "out"


def copy_of_run(sd15_run: tuple[dict, Path], directory: Path) -> tuple[dict, Path]:
    """sd15_run copied to directory/out, with a manifest of its own that writes there."""
    import copy
    import shutil

    manifest, out = sd15_run
    shutil.copytree(out, directory / "out")
    manifest = copy.deepcopy(manifest)
    manifest["spec"]["checkpoints"]["uri"] = str(directory / "out")
    return manifest, directory / "out"


VALIDATION_PROMPT = "a red circle"


def each_step_manifest(model: Path, data: Path, out: Path, **validation) -> dict:
    """Two SD1.5 steps, a checkpoint at each, a quarter of the captions held out; validation extends spec.validation."""
    return family_job("sd15", "captions", model, data, out, checkpoints={"everySteps": 1},
                      validation={"heldOutFraction": 0.25, **validation})


@pytest.fixture(scope="session")
def validated_sd15_run(tiny_sd15, captions_data, tmp_path_factory) -> Path:
    """Two steps, a checkpoint and a validation (loss, and one prompt drawn in 2 steps) at each, the base's at
    step 0, the 3 best kept: the run's folder, with its report. Trained once per session for `kubetune
    generate`'s and `kubetune report`'s tests; read-only (a test that changes it copies it)."""
    root = tmp_path_factory.mktemp("validated-sd15-run")
    run_trainer(each_step_manifest(tiny_sd15, captions_data, root / "out", everySteps=1, prompts=[VALIDATION_PROMPT],
                                   numInferenceSteps=2, keepBest=3), root)
    return run_dir(root / "out")


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    """A random-weight CLIP model for spec.validation.clipModel, written once per session."""
    from kubetune_trainer.models.tiny_models import write_tiny_clip

    return write_tiny_clip(tmp_path_factory.mktemp("clip"), seed=0)


def family_job(family: str, layout: str, model_dir: Path, data_dir: Path, out: Path, **spec_parts) -> dict:
    """A two-step CPU manifest for any family; spec_parts extend spec sections (a None value removes a field)."""
    from kubetune_api.families import FAMILIES, LORA_RANK

    spec = {
        "model": {"family": family, "pretrained": str(model_dir)},
        # A small LoRA where the family trains one (PMG trains its own parts and refuses a LoRA shape).
        "adapter": {"type": "lora", "rank": 4, "alpha": 4} if LORA_RANK in FAMILIES[family].honours else {},
        "data": {"layout": layout, "uri": str(data_dir), "resolution": 32},
        "training": {"maxSteps": 2, "batchSize": 2, "learningRate": 1e-2, "seed": 3},
        "checkpoints": {"uri": str(out), "everySteps": 2, "keepLast": 10},
        "resources": {"gpusPerNode": 0},
    }
    for section, values in spec_parts.items():
        merged = {**spec.get(section, {}), **values}
        spec[section] = {key: value for key, value in merged.items() if value is not None}
    return {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "tiny"},
            "spec": spec}


def run_trainer_expecting_failure(manifest: dict, directory: Path) -> str:
    """Run the trainer, assert it refused the job (exit 2), return its stderr."""
    result = run_trainer_on(write_manifest(manifest, directory))
    assert result.returncode == 2, result.stderr[-4000:]
    return result.stderr


def saved_keys(checkpoint: Path) -> list[str]:
    """The names of the tensors a checkpoint's sharded state holds (model., optimizer., ema.)."""
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(checkpoint / "state").read_metadata().state_dict_metadata)


def trained_weights(checkpoint: Path) -> dict:
    """The trained parameters of a checkpoint, whole, by name (read from its sharded state)."""
    import torch
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(checkpoint / "state").read_metadata().state_dict_metadata
    state = {"model": {name.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
                       for name, item in metadata.items() if name.startswith("model.")}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint / "state"))
    return state["model"]


@pytest.fixture(scope="session")
def configs(tmp_path_factory):
    """Config-only folders (no weights) of every family's real architecture."""
    from kubetune_api.spec import LAYOUTS_BY_FAMILY
    from kubetune_trainer.models.reference_models import write_config_only

    root = tmp_path_factory.mktemp("configs")
    return {family: write_config_only(family, root / family) for family in LAYOUTS_BY_FAMILY}


@pytest.fixture(scope="session")
def planner():
    """`kubetune plan`'s estimator, for a CUDA GPU."""
    from kubetune_trainer.planning.estimate import Planner

    return Planner("cuda")
