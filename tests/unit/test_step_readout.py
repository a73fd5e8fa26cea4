"""Each step's loss, stop request and memory are read one step late, and at once where the run needs them."""
from __future__ import annotations

import torch

from kubetune_trainer.telemetry.step_readout import StepReadout


def one_process(row: torch.Tensor) -> torch.Tensor:
    return row


def two_processes(other_loss: float, other_stop: bool):
    """A gather as two processes see it: this one's row, then the other's."""
    def gather(row: torch.Tensor) -> torch.Tensor:
        other = torch.tensor([[other_loss, float(other_stop), 7.0, 9.0]], dtype=torch.float64)
        return torch.cat([row, other])
    return gather


def test_a_step_is_read_after_the_next_one_is_queued():
    readout = StepReadout(torch.device("cpu"), global_batch=4, gather=one_process)
    readout.push(1, 0, 1e-4, torch.tensor(2.0), stop_requested=False)
    assert readout.read() == [], "the newest step stays queued: reading it would wait for the GPU"
    readout.push(2, 0, 2e-4, torch.tensor(6.0), stop_requested=False)
    [first] = readout.read()
    assert (first.step, first.lr, first.loss) == (1, 1e-4, 0.5), "the loss sum over the global batch"
    assert readout.read() == []


def test_a_drain_reads_every_queued_step_in_order():
    readout = StepReadout(torch.device("cpu"), global_batch=2, gather=one_process)
    for step in (1, 2, 3):
        readout.push(step, 0, 1e-4, torch.tensor(float(step)), stop_requested=False)
    assert [r.step for r in readout.read()] == [1, 2]
    [last] = readout.read(drain=True)
    assert last.step == 3 and last.loss == 1.5
    assert readout.read(drain=True) == []


def test_every_process_learns_of_a_stop_request_and_each_ones_memory():
    readout = StepReadout(torch.device("cpu"), global_batch=4, gather=two_processes(other_loss=2.0, other_stop=True))
    readout.push(1, 0, 1e-4, torch.tensor(2.0), stop_requested=False)
    [result] = readout.read(drain=True)
    assert result.stop_requested, "the other process's SIGTERM stops this one too"
    assert result.loss == 1.0, "both processes' sums over the global batch"
    assert result.memory == [(0, 0), (7, 9)], "per process, in rank order"


def test_a_non_finite_loss_is_read_as_such():
    readout = StepReadout(torch.device("cpu"), global_batch=1, gather=one_process)
    readout.push(1, 0, 1e-4, torch.tensor(float("nan")), stop_requested=False)
    [result] = readout.read(drain=True)
    assert result.loss != result.loss


def test_the_steps_end_time_is_when_it_was_queued_not_when_it_was_read():
    import time

    readout = StepReadout(torch.device("cpu"), global_batch=1, gather=one_process)
    before = time.time()
    readout.push(1, 0, 1e-4, torch.tensor(1.0), stop_requested=False)
    time.sleep(0.05)
    [result] = readout.read(drain=True)
    assert before <= result.ended < before + 0.05
