"""The order in which samples are trained: per optimizer step, global, resumable at any world size.

An epoch is a seeded permutation of the samples cut into optimizer steps of `global_batch`
samples (the spec's batchSize x processes x gradientAccumulationSteps at the run's start). The
steps depend only on the seed, the epoch and the global batch, never on the number of
processes, so the position of a run is (epoch, steps done in it) and a checkpoint written by N
processes resumes on M: each step's samples are the same, only split differently (Batching).

A batch is a list of keys (epoch, index): every random choice a transform or the loss makes is
derived from the key (training/randomness.py, data/keyed.py), not from a process's generator.

With aspect-ratio buckets (`groups`: a bucket id per sample) every step's samples come from one
bucket, so each process's micro-batch stacks into one tensor and all train on one shape.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kubetune_trainer.errors import ConfigError

Key = tuple[int, int]  # (epoch, sample index)


def even_split(items: Sequence, parts: int) -> list[list]:
    """`parts` consecutive slices whose sizes differ by at most one (larger ones first)."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [list(items[bounds[i]:bounds[i + 1]]) for i in range(parts)]


@dataclass(frozen=True)
class Batching:
    """How one optimizer step's samples are split: `micro_batches` in turn, each over the processes.

    The loss of a process's micro-batch is weighted by its share of the step (loss_weight), so
    the averaged gradient is the mean over the step's samples however they were split.
    """

    global_batch: int
    world_size: int
    micro_batches: int

    @classmethod
    def fresh(cls, batch_size: int, world_size: int, accumulation: int) -> "Batching":
        """A run's start: the spec's per-process batch and accumulation on this many processes."""
        return cls(batch_size * world_size * accumulation, world_size, accumulation)

    @classmethod
    def keeping(cls, global_batch: int, world_size: int, max_batch_size: int) -> "Batching":
        """A resumed run on `world_size` processes: the same global batch, micro-batches of at
        most max_batch_size per process where that leaves every process a sample in each."""
        if global_batch < world_size:
            raise ConfigError(
                f"this run's global batch is {global_batch} samples per optimizer step, fewer than the "
                f"{world_size} processes now running it (every process needs a sample); run it on at most "
                f"{global_batch} processes (spec.resources.nodes x gpusPerNode or distributed.processesPerNode)")
        micro = min(math.ceil(global_batch / (world_size * max_batch_size)), global_batch // world_size)
        return cls(global_batch, world_size, micro)

    @property
    def largest_micro_batch(self) -> int:
        return math.ceil(self.global_batch / (self.micro_batches * self.world_size))

    def micro_batch(self, step: Sequence, micro: int, rank: int) -> list:
        """The samples process `rank` trains in micro-batch `micro` of an optimizer step."""
        return even_split(even_split(step, self.micro_batches)[micro], self.world_size)[rank]

    def loss_weight(self, samples: int) -> float:
        """Scales a micro-batch's mean loss so that averaging over processes gives the step's mean."""
        return samples * self.world_size / self.global_batch

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = {self.world_size} process(es) x "
                f"{self.micro_batches} micro-batch(es) of up to {self.largest_micro_batch}")


def _bucket_members(order: list[int], groups: Sequence[int] | None) -> list[list[int]]:
    if groups is None:
        return [order]
    return [[i for i in order if groups[i] == group] for group in sorted(set(groups))]


def steps_per_epoch(num_samples: int, global_batch: int, groups: Sequence[int] | None = None) -> int:
    """Whole optimizer steps in an epoch (each bucket's remainder is dropped)."""
    members = _bucket_members(list(range(num_samples)), groups)
    return sum(len(m) // global_batch for m in members)


def epoch_steps(num_samples: int, global_batch: int, seed: int, epoch: int,
                groups: Sequence[int] | None = None) -> list[list[Key]]:
    """Every optimizer step of an epoch: `global_batch` keys each, in training order."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(num_samples, generator=generator).tolist()
    steps = []
    for members in _bucket_members(order, groups):
        usable = len(members) // global_batch * global_batch
        steps += [members[start:start + global_batch] for start in range(0, usable, global_batch)]
    if groups is not None:  # buckets take turns in a seeded order, not one after the other
        steps = [steps[i] for i in torch.randperm(len(steps), generator=generator).tolist()]
    return [[(epoch, i) for i in step] for step in steps]


def check_enough_samples(num_samples: int, global_batch: int, groups: Sequence[int] | None = None) -> None:
    if steps_per_epoch(num_samples, global_batch, groups) == 0:
        # Groups batch alike: an aspect-ratio bucket, a frame count, a number of control images.
        where = (" in any group batched together (one aspect-ratio bucket with spec.data.bucketing, one count of "
                 "spec.data.frames, one number of control images)") if groups is not None else ""
        raise ConfigError(
            f"spec.training.batchSize: the data has {num_samples} samples, fewer than one optimizer step "
            f"({global_batch} = batchSize x processes x gradientAccumulationSteps){where}; "
            "lower batchSize or gradientAccumulationSteps, or add data"
        )


def shard_for_encoding(num_samples: int, batch_size: int, world_size: int, rank: int,
                       groups: Sequence[int] | None = None) -> list[list[Key]]:
    """This process's share of every sample once (epoch 0's keys), in batches within a group (so
    each batch stacks): the cache stage."""
    mine = list(range(rank, num_samples, world_size))
    return [[(0, i) for i in members[start:start + batch_size]] for members in _bucket_members(mine, groups)
            for start in range(0, len(members), batch_size)]


def in_order(num_samples: int, batch_size: int, groups: Sequence[int] | None = None) -> list[list[Key]]:
    """Every sample once, in index order, batches within a bucket (held-out evaluation)."""
    return [[(0, i) for i in members[start:start + batch_size]]
            for members in _bucket_members(list(range(num_samples)), groups)
            for start in range(0, len(members), batch_size)]
