"""The optimizer step every family shares, and the order of the steps in an epoch.

The family only turns a batch into a loss; accumulation over micro-batches, the weighting that
makes any split of a step's samples give the same gradient, backward, clipping, the optimizer
and the schedule live here. Steps come from data.sampler in a seeded global order, so the run's
position is two integers a checkpoint stores.
"""
from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from kubetune_api.spec_training import TrainingSpec
from kubetune_trainer.data.sampler import Batching, Key
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.telemetry.phase_clock import PhaseClock
from kubetune_trainer.training.randomness import SampleRandom

MicroBatch = tuple[list[Key], dict]  # the keys of its samples and the collated batch


@dataclass(frozen=True)
class Plan:
    total_steps: int
    steps_per_epoch: int


def plan_steps(training: TrainingSpec, steps_per_epoch: int) -> Plan:
    """Optimizer steps to run: maxSteps, or `epochs` passes over the data."""
    if training.max_steps is not None:
        return Plan(training.max_steps, steps_per_epoch)
    total = training.epochs * steps_per_epoch
    if total == 0:
        raise ConfigError(
            f"spec.training.epochs: {training.epochs} epoch(s) make no optimizer step: the data has fewer samples "
            "than one step takes (batchSize x processes x gradientAccumulationSteps); lower them or add data"
        )
    return Plan(total, steps_per_epoch)


def step_micro_batches(steps: list[list[Key]], batching: Batching, rank: int) -> list[list[list[Key]]]:
    """For each optimizer step, this rank's micro-batches (lists of keys)."""
    return [[batching.micro_batch(step, micro, rank) for micro in range(batching.micro_batches)]
            for step in steps]


# A loader worker that gives no batch for this long is stuck (it inherited a lock held at its fork, a read
# that never ends): the run fails naming the batch it waited for rather than hanging until the pod is
# killed. Far above what a batch takes (seconds, for large images over a slow link or retried reads).
LOADER_WAIT_SECONDS = 600


class LoaderStalled(RuntimeError):
    """The loader's workers gave no batch within LOADER_WAIT_SECONDS."""


def iterate_steps(dataset, collate, num_workers: int, steps: list[list[list[Key]]],
                  loader_seed: int) -> Iterator[list[MicroBatch]]:
    """Load the micro-batches of the given steps in order (workers prefetch ahead); yield them a
    step at a time. The loader gets its own generator: creating an iterator otherwise draws from
    the global torch RNG, and a resumed run (which creates one mid-epoch) would drift.

    With workers, the first step is loaded in this process before they start: its samples are what
    this process's prefetcher is fetching (the first step alone, storage.stream.Prefetcher), and a
    read here waits for that fetch and takes its copy (storage.members, storage.stream), where a
    worker just forked cannot see the fetch and would read the same row groups or objects a second
    time, on the same cores, after its own start. The workers then start on the second step while
    the first one trains. The same samples in the same order either way."""
    flat = [keys for step in steps for keys in step]
    if not flat:
        return
    here = len(steps[0]) if num_workers else len(flat)  # micro-batches loaded in this process
    batches = iter(_loader(dataset, collate, flat[:here], 0, loader_seed))
    if here < len(flat):
        first = [_next_batch(batches, keys, 0) for keys in flat[:here]]
        batches = itertools.chain(first, iter(_loader(dataset, collate, flat[here:], num_workers, loader_seed)))
    for step in steps:
        yield [(keys, _next_batch(batches, keys, num_workers)) for keys in step]


def _loader(dataset, collate, batches: list[list[Key]], num_workers: int, loader_seed: int) -> DataLoader:
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(loader_seed),
                      timeout=LOADER_WAIT_SECONDS if num_workers else 0)


def _next_batch(batches: Iterator[dict], keys: list[Key], num_workers: int) -> dict:
    """The loader's next batch. A ConfigError (a sample broken under the run, named in one line) raised
    in a worker comes back as the same type whose message is the worker's whole traceback (torch's
    ExceptionWrapper): it is raised again with the worker's own one line."""
    try:
        return next(batches)
    except ConfigError as err:
        text = str(err)
        if "Original Traceback" not in text:
            raise
        own = text.rstrip().rsplit("\n", 1)[-1]
        raise ConfigError(own.split(f"{ConfigError.__name__}: ", 1)[-1]) from None
    except RuntimeError as err:
        if not str(err).startswith("DataLoader timed out"):
            raise
        shown = ", ".join(map(str, keys[:4])) + (", ..." if len(keys) > 4 else "")
        raise LoaderStalled(f"the data loader's {num_workers} worker(s) gave no batch in {LOADER_WAIT_SECONDS} s "
                            f"(samples {shown}): a worker is stuck (a read of spec.data.uri that never returns, or a lock "
                            "it inherited held at its fork)") from None


class SampleLog:
    """KUBETUNE_SAMPLE_LOG=FILE: every process appends which samples it trained at which step
    (JSON lines), to check data order across restarts and world sizes; with clips, where each
    sample started in its clip too (frame_starts, in the keys' order)."""

    def __init__(self, rank: int, path: str | None = None):
        self.rank = rank
        path = path if path is not None else os.environ.get("KUBETUNE_SAMPLE_LOG")
        self.path = Path(path) if path else None

    def record(self, step: int, micro_batches: list[MicroBatch]) -> None:
        if self.path is None:
            return
        keys = [list(key) for batch_keys, _ in micro_batches for key in batch_keys]
        record = {"step": step, "rank": self.rank, "keys": keys}
        if all("frame_starts" in batch for _, batch in micro_batches):
            record["frame_starts"] = [int(start) for _, batch in micro_batches for start in batch["frame_starts"]]
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")


class Stepper:
    """Runs one optimizer step of the run over this process's micro-batches."""

    def __init__(self, family, model, optimizer, scheduler, parallel, batching: Batching,
                 training: TrainingSpec, clock: PhaseClock):
        self.family, self.model, self.optimizer, self.scheduler = family, model, optimizer, scheduler
        self.parallel, self.batching, self.training, self.clock = parallel, batching, training, clock

    def step(self, step: int, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, float]:
        """Train optimizer step `step` (0-based); returns the sum of this process's samples' losses,
        on the device and not read (reading waits for the GPU: step_readout reads it a step later),
        and the step's learning rate."""
        device = next(iter(self.family.trainable_parameters())).device
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        for index, (keys, batch) in enumerate(micro_batches):
            self.clock.mark("data_wait")
            random = SampleRandom.for_keys(self.training.seed, keys, step)
            weight = self.batching.loss_weight(len(keys))
            syncing = index == len(micro_batches) - 1
            # Between micro-batches gradients accumulate locally; only the last one synchronises.
            with self._maybe_no_sync(not syncing):
                loss = self.family.compute_loss(self.model, batch, random)
                self.parallel.backward(loss * weight)
            loss_sum += loss.detach().double() * len(keys)
            self.clock.mark("forward_backward")
        if self.training.max_grad_value is not None:  # element-wise: the same on every rank and shard
            torch.nn.utils.clip_grad_value_([p for p in self.model.parameters() if p.requires_grad],
                                            self.training.max_grad_value)
        if self.training.max_grad_norm > 0:
            self.parallel.clip_grad_norm(self.model, self.training.max_grad_norm)
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.clock.mark("optimizer")
        return loss_sum, lr

    def _maybe_no_sync(self, skip: bool):
        from contextlib import nullcontext

        return self.parallel.no_sync(self.model) if skip else nullcontext()
