"""Everything a checkpoint holds beyond the weights, and how a run is put back to it.

The position (step, epoch, batches done) plus optimizer, scheduler and every RNG a process uses
are enough for a resumed run to take exactly the steps an uninterrupted run would have taken.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

TRAINABLE = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
POSITION = "trainer_state.json"
log = logging.getLogger(__name__)


@dataclass
class Position:
    """Where the run is: optimizer steps done and where in the data the next batch comes from."""

    step: int = 0
    epoch: int = 0
    batches_done_in_epoch: int = 0
    micro_batches: int = 0
    loss: float | None = None


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def capture_rng(noise_generator: torch.Generator) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "noise": noise_generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, noise_generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    noise_generator.set_state(state["noise"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_main_state(path: Path, trainable: dict[str, torch.Tensor], optimizer, scheduler, position: Position) -> None:
    """The parts every process shares (identical under DDP): written by the main process."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(trainable, path / TRAINABLE)
    torch.save(optimizer.state_dict(), path / OPTIMIZER)
    torch.save(scheduler.state_dict(), path / SCHEDULER)
    (path / POSITION).write_text(json.dumps(asdict(position)))


def save_rng_states(path: Path, states: list[dict]) -> None:
    """One file per rank, all written by the main process (states gathered in rank order)."""
    path.mkdir(parents=True, exist_ok=True)
    for rank, state in enumerate(states):
        torch.save(state, path / rng_file(rank))


def read_trainable(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / TRAINABLE)


def restore_state(path: Path, rank: int, optimizer, scheduler, noise_generator: torch.Generator) -> Position:
    """Put optimizer, scheduler and this rank's RNG back; return where the run was."""
    optimizer.load_state_dict(torch.load(path / OPTIMIZER, weights_only=False))
    scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=False))
    rng_path = path / rng_file(rank)
    if rng_path.is_file():
        restore_rng(torch.load(rng_path, weights_only=False), noise_generator)
    else:
        log.warning("%s has no RNG state for rank %d (process count changed?); noise will differ", path, rank)
    return Position(**json.loads((path / POSITION).read_text()))
