"""The step-phase clock: exact CPU marks; on CUDA, events read once the GPU has passed them, never a
device-wide synchronisation per mark. A fake GPU stands in for CUDA (its events are the real protocol)."""
import pytest
import torch

from kubetune_trainer.telemetry import phase_clock
from kubetune_trainer.telemetry.phase_clock import PhaseClock

CUDA = torch.device("cuda")  # a device descriptor only: nothing here touches a GPU


class Reporter:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.charged: list[tuple[str, float]] = []

    def phase(self, name: str, seconds: float) -> None:
        self.charged.append((name, round(seconds, 6)))


class FakeGpu:
    """A stream whose work finishes when the test says: `queue(ms)` adds work, `run(ms)` lets time pass."""

    def __init__(self):
        self.now = 0.0          # ms on the device's clock
        self.busy_until = 0.0   # when the queued work is done
        self.events_made = 0
        self.waits: list["FakeEvent"] = []

    def queue(self, ms: float) -> None:
        self.busy_until = max(self.busy_until, self.now) + ms

    def run(self, ms: float) -> None:
        self.now += ms

    def new_event(self) -> "FakeEvent":
        self.events_made += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu):
        self.gpu, self.at = gpu, None

    def record(self) -> None:
        self.at = max(self.gpu.busy_until, self.gpu.now)  # reached when the work queued before it is done

    def query(self) -> bool:
        return self.gpu.now >= self.at

    def synchronize(self) -> None:
        self.gpu.waits.append(self)
        self.gpu.now = max(self.gpu.now, self.at)

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "CUDA refuses elapsed_time on an event not yet reached"
        return end.at - self.at


@pytest.fixture
def gpu(monkeypatch):
    def no_device_sync(*_):
        raise AssertionError("the clock must not synchronise the whole device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    return FakeGpu()


def test_cpu_marks_charge_the_wall_time_since_the_previous_mark(monkeypatch):
    times = iter([10.0, 10.5, 12.0, 20.0, 20.25])
    monkeypatch.setattr(phase_clock.time, "perf_counter", lambda: next(times))
    reporter = Reporter()
    clock = PhaseClock(reporter, torch.device("cpu"))   # starts at 10.0
    clock.mark("data_wait")                             # 10.5
    clock.mark("forward_backward")                      # 12.0
    clock.restart()                                     # 20.0: checkpointing, charged elsewhere
    clock.mark("data_wait")                             # 20.25
    assert reporter.charged == [("data_wait", 0.5), ("forward_backward", 1.5), ("data_wait", 0.25)]


def test_gpu_phases_are_charged_once_the_device_has_passed_them_without_waiting(gpu):
    reporter = Reporter()
    clock = PhaseClock(reporter, CUDA, new_event=gpu.new_event)
    gpu.run(2)                      # the data loader: the GPU idles 2 ms
    clock.mark("data_wait")
    gpu.queue(30)                   # forward and backward are queued; the CPU returns at once
    clock.mark("forward_backward")
    assert reporter.charged == [("data_wait", 0.002)], "forward/backward is still running"
    assert gpu.waits == []
    gpu.run(30)
    gpu.queue(5)
    clock.mark("optimizer")         # the GPU has just finished forward/backward
    assert reporter.charged == [("data_wait", 0.002), ("forward_backward", 0.030)]
    gpu.run(5)
    clock.mark("data_wait")
    assert reporter.charged[2:] == [("optimizer", 0.005), ("data_wait", 0.0)]
    assert gpu.waits == []


def test_restart_drops_the_time_before_it(gpu):
    reporter = Reporter()
    clock = PhaseClock(reporter, CUDA, new_event=gpu.new_event)
    gpu.run(1)
    clock.mark("data_wait")
    gpu.run(500)                    # a checkpoint, timed by its own phase
    clock.restart()
    gpu.run(3)
    clock.mark("data_wait")
    assert reporter.charged == [("data_wait", 0.001), ("data_wait", 0.003)]


def test_a_long_queue_waits_for_its_oldest_mark_only(gpu):
    reporter = Reporter()
    clock = PhaseClock(reporter, CUDA, new_event=gpu.new_event, max_pending=3)
    for _ in range(3):
        gpu.queue(10)
        clock.mark("forward_backward")
    assert reporter.charged == [] and gpu.waits == []
    gpu.queue(10)
    clock.mark("forward_backward")  # a fourth pending mark: wait for the first
    assert len(gpu.waits) == 1 and gpu.now == 10.0, "waited until the oldest mark, not the whole queue"
    assert reporter.charged == [("forward_backward", 0.010)]


def test_flush_charges_every_mark_so_far(gpu):
    reporter = Reporter()
    clock = PhaseClock(reporter, CUDA, new_event=gpu.new_event)
    gpu.queue(7)
    clock.mark("forward_backward")
    gpu.queue(2)
    clock.mark("optimizer")
    assert reporter.charged == []
    clock.flush()
    assert reporter.charged == [("forward_backward", 0.007), ("optimizer", 0.002)]
    assert gpu.waits[-1].at == 9.0


def test_the_phases_add_up_to_the_device_time_and_events_are_reused(gpu):
    reporter = Reporter()
    clock = PhaseClock(reporter, CUDA, new_event=gpu.new_event)
    for step in range(100):
        gpu.run(1)
        clock.mark("data_wait")
        gpu.queue(20)
        clock.mark("forward_backward")
        gpu.run(20)
        gpu.queue(3)
        clock.mark("optimizer")
        gpu.run(3)
    clock.flush()
    assert len(reporter.charged) == 300
    assert sum(seconds for _, seconds in reporter.charged) == pytest.approx(gpu.now / 1000)
    assert gpu.events_made <= 4, "resolved events are recorded again, not created per mark"


def test_a_rank_that_does_not_report_records_no_events(gpu):
    reporter = Reporter(enabled=False)
    clock = PhaseClock(reporter, CUDA, new_event=gpu.new_event)
    clock.mark("data_wait")
    clock.restart()
    clock.flush()
    assert gpu.events_made == 0
