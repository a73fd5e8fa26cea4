"""Random draws per sample: what a sample gets never depends on which process trains it.

Noise, timesteps, noise levels and latent samples are drawn from a generator of their own for
each sample, seeded by (seed, epoch, index, step). N processes at a per-process batch of B/N
then draw exactly what one process at batch B draws for the same samples, a run resumed on
another number of processes continues the same stream, and a held-out sample gets the same
noise at every validation (so two checkpoints' validation losses compare fairly).

Data augmentation is keyed the same way (data.keyed.KeyedDataset.rng). What still draws from a
process's own generator is dropout (spec.adapter.dropout); its state is checkpointed per rank,
so it is exact on the same number of processes only.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kubetune_trainer.training.device_copy import to_device

Key = tuple[int, int]  # (epoch, sample index)
VALIDATION_STEP = -1  # the "step" of held-out draws: the same at every validation


def sample_seed(seed: int, key: Key, step: int) -> int:
    """A 63-bit seed that changes with any of its parts (a hash: nearby keys share nothing)."""
    digest = hashlib.blake2b(f"{seed}:{key[0]}:{key[1]}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SampleRandom:
    """The random draws of one batch: row i comes from sample i's own generator.

    Each method draws one value (or tensor) per sample, on the CPU, in float32, and returns a
    batch-first tensor on `device`: where and in which precision the model runs never changes
    the numbers drawn.
    """

    def __init__(self, generators: Sequence[torch.Generator]):
        self.generators = list(generators)

    @classmethod
    def for_keys(cls, seed: int, keys: Sequence[Key], step: int) -> "SampleRandom":
        return cls([torch.Generator().manual_seed(sample_seed(seed, key, step)) for key in keys])

    def __len__(self) -> int:
        return len(self.generators)

    def _stack(self, draw, device, dtype) -> torch.Tensor:
        return to_device(torch.stack([draw(g) for g in self.generators]), device, dtype)

    def normal(self, shape: Sequence[int], device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal noise of shape [batch, *shape]."""
        return self._stack(lambda g: torch.randn(tuple(shape), generator=g), device, dtype)

    def uniform(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """One value in [0, 1) per sample."""
        return self._stack(lambda g: torch.rand((), generator=g), device, torch.float32)

    def integers(self, high: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """One integer in [0, high) per sample (int64)."""
        return self._stack(lambda g: torch.randint(0, high, (), generator=g), device, torch.int64)
