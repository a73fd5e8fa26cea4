"""The order in which samples are visited: deterministic, sharded across processes, resumable.

A batch is a list of keys (epoch, index). The order of an epoch depends only on the seed and the
epoch number, so a resumed run can skip exactly the batches it already trained on, and every
random choice a transform makes can be derived from the key instead of a global RNG.

With aspect-ratio buckets (`groups`: a bucket id per sample) every global step's samples come from
one bucket, so each rank's batch stacks into one tensor and all ranks train on one shape per step.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kubetune_trainer.errors import ConfigError

Key = tuple[int, int]  # (epoch, sample index)


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int,
                      groups: Sequence[int] | None = None) -> int:
    """Full batches each process gets per epoch (each bucket's remainder is dropped, as in DDP training)."""
    per_step = batch_size * world_size
    if groups is None:
        return num_samples // per_step
    return sum(list(groups).count(g) // per_step for g in set(groups))


def _global_steps(order: list[int], per_step: int, groups: Sequence[int] | None,
                  generator: torch.Generator) -> list[list[int]]:
    """The samples of each global step: consecutive in `order`, or per bucket then shuffled."""
    if groups is None:
        usable = len(order) // per_step * per_step
        return [order[start:start + per_step] for start in range(0, usable, per_step)]
    steps = []
    for group in sorted(set(groups)):
        members = [i for i in order if groups[i] == group]
        usable = len(members) // per_step * per_step
        steps += [members[start:start + per_step] for start in range(0, usable, per_step)]
    return [steps[i] for i in torch.randperm(len(steps), generator=generator).tolist()]


def epoch_batches(num_samples: int, batch_size: int, world_size: int, rank: int,
                  seed: int, epoch: int, groups: Sequence[int] | None = None) -> list[list[Key]]:
    """This rank's batches for one epoch: a seeded permutation dealt to the ranks step by step."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(num_samples, generator=generator).tolist()
    steps = _global_steps(order, batch_size * world_size, groups, generator)
    return [[(epoch, i) for i in step[rank * batch_size:(rank + 1) * batch_size]] for step in steps]


def check_enough_samples(num_samples: int, batch_size: int, world_size: int,
                         groups: Sequence[int] | None = None) -> None:
    if batches_per_epoch(num_samples, batch_size, world_size, groups) == 0:
        where = " in any aspect-ratio bucket (spec.data.bucketing)" if groups is not None else ""
        raise ConfigError(
            f"spec.training.batchSize: the data has {num_samples} samples, fewer than one batch "
            f"for every process ({batch_size} x {world_size} processes){where}; lower batchSize or add data"
        )
