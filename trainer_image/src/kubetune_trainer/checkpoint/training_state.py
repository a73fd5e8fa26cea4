"""Where a run is, beyond its weights and optimizer: the position in the data, the batching it
trains with, and each process's random state.

The position is in optimizer steps of the run's global batch (data.sampler), so a checkpoint
written by N processes is continued by M at the same samples: the global batch is kept and the
micro-batches adjust. Only when the global batch itself changes (a new run that starts from
this checkpoint with another batchSize or gradientAccumulationSteps) is the position remapped,
by samples, and the log says so.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
log = logging.getLogger(__name__)


@dataclass
class Position:
    """Optimizer steps done, and how many of them in the current epoch."""

    step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    loss: float | None = None


@dataclass(frozen=True)
class SavedState:
    """What trainer_state.json records about the run that wrote a checkpoint."""

    position: Position
    global_batch: int
    world_size: int
    batch_size: int  # spec.training.batchSize of that run
    accumulation: int  # spec.training.gradientAccumulationSteps of that run
    strategy: str
    base_model: str | None = None  # storage.inputs.version_of(spec.model.pretrained); None before it was kept

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps({**data, "position": asdict(self.position)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "SavedState":
        data = json.loads(text)
        return cls(**{**data, "position": Position(**data["position"])})


def read_saved_state(checkpoint: Path) -> SavedState:
    return SavedState.from_json((checkpoint / STATE_FILE).read_text())


def continue_position(saved: Position, saved_global_batch: int, global_batch: int) -> Position:
    """The position under `global_batch`: the same when it is unchanged, else the same number of
    samples into the epoch, rounded down to whole steps (the epoch's order is one permutation)."""
    if saved_global_batch == global_batch:
        return replace(saved)
    samples = saved.steps_in_epoch * saved_global_batch
    return replace(saved, steps_in_epoch=samples // global_batch)


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def capture_rng() -> dict:
    """The process-wide generators (dropout draws from torch's); per-sample draws need none."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(path: Path, rank: int) -> Path:
    """Each process writes its own file into its node's copy of the checkpoint."""
    path.mkdir(parents=True, exist_ok=True)
    target = path / rng_file(rank)
    torch.save(capture_rng(), target)
    return target


def load_rng(path: Path, rank: int, same_world: bool) -> None:
    """Restore this rank's generators; with another process count they cannot line up, and only
    dropout differs from an uninterrupted run (said once, by the caller's log)."""
    file = path / rng_file(rank)
    if same_world and file.is_file():
        restore_rng(torch.load(file, weights_only=False))
