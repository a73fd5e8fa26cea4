"""The one training loop every family shares.

Accumulation, clipping, precision, LR stepping, progress and checkpoint timing live here; the
family only turns a batch into a loss. Micro-batches come in a seeded order (data.sampler), so
the loop's position is a few integers that a checkpoint can store and a resume can skip to.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.data import DataLoader

from kubetune_api.spec import TrainingSpec
from kubetune_trainer.data.sampler import epoch_batches
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.reporting import Reporter
from kubetune_trainer.training_state import Position


@dataclass(frozen=True)
class Plan:
    total_steps: int
    batches_per_epoch: int


def plan_steps(training: TrainingSpec, batches_per_epoch: int) -> Plan:
    """Optimizer steps to run: maxSteps, or the whole micro-batches of `epochs` passes."""
    if training.max_steps is not None:
        return Plan(training.max_steps, batches_per_epoch)
    total = training.epochs * batches_per_epoch // training.gradient_accumulation_steps
    if total == 0:
        raise ConfigError(
            f"spec.training.epochs: {training.epochs} epoch(s) of {batches_per_epoch} batches make no "
            f"optimizer step with gradientAccumulationSteps {training.gradient_accumulation_steps}; "
            "train for more epochs or accumulate less"
        )
    return Plan(total, batches_per_epoch)


class PhaseClock:
    """Charges the wall time since the previous mark to the phase that just ended.

    On a GPU the work is asynchronous, so each mark waits for the device first; otherwise the
    time of a forward pass would show up wherever the next synchronisation happens to fall.
    """

    def __init__(self, reporter: Reporter, device: torch.device):
        self.reporter = reporter
        self.synchronize = torch.cuda.synchronize if device.type == "cuda" and reporter.enabled else None
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.synchronize is not None:
            self.synchronize()
        now = time.perf_counter()
        self.reporter.phase(phase, now - self.last)
        self.last = now

    def restart(self) -> None:
        """Forget the time since the last mark (it was charged elsewhere, e.g. to checkpointing)."""
        self.last = time.perf_counter()


def memory_in_use(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) bytes of this process's GPU; zeros on the CPU."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def train(accelerator, family: ModelFamily, model: torch.nn.Module, optimizer, scheduler,
          dataset, position: Position, plan: Plan, reporter: Reporter,
          noise_generator: torch.Generator, on_step_end: Callable[[Position], None]) -> Position:
    """Run optimizer steps until plan.total_steps; call on_step_end after each (checkpoints)."""
    training = family.spec.training
    accumulation = training.gradient_accumulation_steps
    params = family.trainable_parameters()
    running_loss = torch.zeros((), device=accelerator.device)
    clock = PhaseClock(reporter, accelerator.device)

    while position.step < plan.total_steps:
        groups = getattr(dataset, "groups", None)  # aspect-ratio buckets
        batches = epoch_batches(len(dataset), training.batch_size, accelerator.num_processes,
                                accelerator.process_index, training.seed, position.epoch, groups)
        if training.debug_overfit_batch:  # epoch 0's first batch, augmentations included, every time
            first = epoch_batches(len(dataset), training.batch_size, accelerator.num_processes,
                                  accelerator.process_index, training.seed, 0, groups)[0]
            batches = [first] * len(batches)
        # The loader gets its own generator: creating an iterator otherwise draws from the global
        # torch RNG, and a resumed run (which creates one mid-epoch) would drift from the original.
        loader = DataLoader(dataset, batch_sampler=batches[position.batches_done_in_epoch:],
                            collate_fn=family.collate, num_workers=family.spec.data.num_workers,
                            generator=torch.Generator().manual_seed(training.seed + position.epoch))
        for batch in loader:
            clock.mark("data_wait")
            syncing = (position.micro_batches + 1) % accumulation == 0
            # Between optimizer steps gradients accumulate locally; only the last micro-batch all-reduces.
            with nullcontext() if syncing else accelerator.no_sync(model):
                loss = family.compute_loss(model, batch, noise_generator)
                accelerator.backward(loss / accumulation)
            running_loss += loss.detach().float()
            clock.mark("forward_backward")
            position.micro_batches += 1
            position.batches_done_in_epoch += 1
            if not syncing:
                continue
            if training.max_grad_norm > 0:
                accelerator.clip_grad_norm_(params, training.max_grad_norm)
            optimizer.step()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            position.step += 1
            position.loss = accelerator.reduce(running_loss / accumulation, reduction="mean").item()
            running_loss.zero_()
            clock.mark("optimizer")
            reporter.step(position.step, position.loss, lr, position.epoch)
            if position.step % training.log_every_steps == 0:  # a collective: every rank takes part
                in_use = accelerator.gather(torch.tensor(memory_in_use(accelerator.device), device=accelerator.device))
                reporter.gpu_memory([tuple(pair) for pair in in_use.view(-1, 2).tolist()])
            on_step_end(position)  # charges checkpointing and validation to their own phases
            clock.restart()
            if position.step >= plan.total_steps:
                break
        else:
            position.epoch += 1
            position.batches_done_in_epoch = 0
    return position
