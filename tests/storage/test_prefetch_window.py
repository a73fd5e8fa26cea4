"""The prefetcher fetches the steps of its window side by side, not one step after another: at batch
1 (one image a step) and 40 ms a request, one step at a time was one request at a time (22 images/s,
benchmarks/data_streaming.py --delay-ms 40). Fetching is stood in for by local files here (the S3
side of a fetch is tests/storage/test_data_streaming.py's): what is checked is the window's
bookkeeping."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.storage.test_data_streaming import wait_for

IMAGE = 1000  # bytes of each stand-in image


@pytest.fixture
def fetches(monkeypatch):
    """Stand-ins for the prefetcher's fetch (each waits for its gate), emptying and listed size."""
    from kubetune_trainer.storage import stream

    state = {"in_flight": 0, "most": 0, "gates": {}, "arrived": set(), "lock": threading.Lock()}

    def fill(path: Path) -> int:
        with state["lock"]:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
            gate = state["gates"].setdefault(path.name, threading.Event())
        gate.wait(timeout=10)
        path.write_bytes(b"x" * IMAGE)
        with state["lock"]:
            state["in_flight"] -= 1
            state["arrived"].add(path.name)
        return IMAGE

    def empty(path: Path) -> int:
        size = path.stat().st_size
        path.write_bytes(b"")
        return size

    def gate(name: str) -> threading.Event:
        with state["lock"]:
            return state["gates"].setdefault(name, threading.Event())

    monkeypatch.setattr(stream, "_fill", fill)
    monkeypatch.setattr(stream, "_empty", empty)
    monkeypatch.setattr(stream, "_listed_size", lambda path: IMAGE)
    state["gate"] = gate
    return state


def one_image_steps(tmp_path: Path, count: int) -> list[list[Path]]:
    steps = []
    for number in range(count):
        (tmp_path / f"{number}.png").write_bytes(b"")
        steps.append([tmp_path / f"{number}.png"])
    return steps


def test_the_steps_of_the_window_are_fetched_side_by_side_and_counted_in_order(fetches, tmp_path):
    from kubetune_trainer.storage import stream

    steps = one_image_steps(tmp_path, 6)
    prefetcher = stream.Prefetcher(budget=1 << 30, ahead_steps=4)
    try:
        prefetcher.plan(steps)
        wait_for(lambda: fetches["in_flight"] == 4, "the window's four steps fetched at once")
        for name in ("1.png", "2.png", "3.png"):  # the later steps arrive first
            fetches["gate"](name).set()
        wait_for(lambda: fetches["in_flight"] == 1, "three steps arrived")
        assert prefetcher.fetched == 0, "a step counts as fetched only once the steps before it are"
        fetches["gate"]("0.png").set()
        wait_for(lambda: prefetcher.fetched == 4, "then the four at once")
        assert prefetcher.on_disk == 4 * IMAGE and prefetcher.in_flight == 0
        assert prefetcher.started_fetch == 4, "nothing beyond the window before a step is trained"
        prefetcher.advance()
        wait_for(lambda: prefetcher.started_fetch == 5, "a trained step makes room for the next")
        assert steps[0][0].stat().st_size == 0 and prefetcher.on_disk == 3 * IMAGE
    finally:
        for gate in fetches["gates"].values():
            gate.set()
        prefetcher.close()
    assert fetches["most"] == 4


def test_the_budget_counts_the_steps_in_flight(fetches, tmp_path):
    from kubetune_trainer.storage import stream

    prefetcher = stream.Prefetcher(budget=int(2.5 * IMAGE), ahead_steps=4)
    try:
        prefetcher.plan(one_image_steps(tmp_path, 6))
        wait_for(lambda: fetches["in_flight"] == 2, "two steps fit the budget")
        threading.Event().wait(0.2)
        assert prefetcher.started_fetch == 2 and fetches["in_flight"] == 2, "a third would pass it, in flight or not"
    finally:
        for gate in fetches["gates"].values():
            gate.set()
        prefetcher.close()


def test_a_step_trained_while_its_fetch_was_in_flight_is_emptied_when_it_arrives(fetches, tmp_path):
    """The loader read it itself meanwhile (a fetch it finds in flight it waits for, one it does not
    it makes); the prefetcher's late copy is no one's to read and would stay on disk uncounted."""
    from kubetune_trainer.storage import stream

    steps = one_image_steps(tmp_path, 3)
    prefetcher = stream.Prefetcher(budget=1 << 30, ahead_steps=2)
    try:
        prefetcher.plan(steps)
        wait_for(lambda: fetches["in_flight"] == 2, "two steps in flight")
        prefetcher.advance()  # step 0 trained before its fetch arrived
        fetches["gate"]("0.png").set()
        wait_for(lambda: "0.png" in fetches["arrived"] and steps[0][0].stat().st_size == 0,
                 "step 0's fetch arrived and was emptied")
        assert prefetcher.on_disk == 0 and prefetcher.fetched == 1 and prefetcher.in_flight == 2 * IMAGE
    finally:
        for gate in fetches["gates"].values():
            gate.set()
        prefetcher.close()
