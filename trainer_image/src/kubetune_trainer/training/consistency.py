"""Replicas must stay identical: a cheap check that every process holds the same trained weights.

Under DDP each process keeps a whole copy of the model and applies the same averaged gradient,
so the copies are bitwise equal; a missing all-reduce (a gradient synchronisation skipped, a
parameter DDP does not know about) makes them drift apart silently, and the published weights
would be one process's alone. At every checkpoint the processes compare a fingerprint of their
weights (sum and sum of squares of each tensor, in float64) and the run stops if they differ.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class ReplicasDiverged(RuntimeError):
    pass


def fingerprint(named_params: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Two float64 numbers per tensor; equal tensors give equal numbers on every process."""
    values = []
    for _, param in named_params:
        data = param.detach().double()
        values += [data.sum(), (data * data).sum()]
    return torch.stack(values).cpu() if values else torch.zeros(0, dtype=torch.float64)


def first_difference(fingerprints: list[torch.Tensor], names: list[str]) -> str | None:
    """The first parameter whose fingerprint differs between processes, with the ranks that differ."""
    reference = fingerprints[0]
    for rank, other in enumerate(fingerprints[1:], start=1):
        differs = (other != reference).nonzero()
        if len(differs):
            return f"{names[int(differs[0]) // 2]} differs between rank 0 and rank {rank}"
    return None


def check_replicas_agree(named_params: list[tuple[str, torch.Tensor]],
                         gather: Callable[[torch.Tensor], list[torch.Tensor]]) -> None:
    """Raise ReplicasDiverged naming the first parameter that differs; `gather` collects one tensor
    from every process (a collective: every process calls this)."""
    difference = first_difference(gather(fingerprint(named_params)), [name for name, _ in named_params])
    if difference is not None:
        raise ReplicasDiverged(f"the processes' copies of the trained weights are no longer the same ({difference}): "
                               "gradients were not averaged over every process")
