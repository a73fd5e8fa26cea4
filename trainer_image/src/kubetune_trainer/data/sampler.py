"""The order in which samples are visited: deterministic, sharded across processes, resumable.

A batch is a list of keys (epoch, index). The order of an epoch depends only on the seed and the
epoch number, so a resumed run can skip exactly the batches it already trained on, and every
random choice a transform makes can be derived from the key instead of a global RNG.
"""
from __future__ import annotations

import torch

from kubetune_trainer.errors import ConfigError

Key = tuple[int, int]  # (epoch, sample index)


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int) -> int:
    """Full batches each process gets per epoch (the remainder is dropped, as in DDP training)."""
    return num_samples // (batch_size * world_size)


def epoch_batches(num_samples: int, batch_size: int, world_size: int, rank: int,
                  seed: int, epoch: int) -> list[list[Key]]:
    """This rank's batches for one epoch: a seeded permutation dealt round-robin to the ranks."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(num_samples, generator=generator).tolist()
    per_step = batch_size * world_size
    batches = []
    for start in range(0, batches_per_epoch(num_samples, batch_size, world_size) * per_step, per_step):
        step_indices = order[start:start + per_step]
        mine = step_indices[rank * batch_size:(rank + 1) * batch_size]
        batches.append([(epoch, i) for i in mine])
    return batches


def check_enough_samples(num_samples: int, batch_size: int, world_size: int) -> None:
    if batches_per_epoch(num_samples, batch_size, world_size) == 0:
        raise ConfigError(
            f"spec.training.batchSize: the data has {num_samples} samples, fewer than one batch "
            f"for every process ({batch_size} x {world_size} processes); lower batchSize or add data"
        )
