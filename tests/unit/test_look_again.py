"""The one timer (operator look_again.py): each active job visited once per interval, spread over it,
never two visits of one job at once, a job out of the index no longer visited, a failure retried."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kubetune_operator.look_again import LookAgain


def run_for(timer: LookAgain, seconds: float) -> None:
    async def main():
        task = asyncio.get_running_loop().create_task(timer.run())
        await asyncio.sleep(seconds)
        task.cancel()
    asyncio.run(main())


def test_every_active_job_is_visited_once_per_interval_spread_over_it():
    visits: list[tuple[float, tuple[str, str]]] = []
    jobs = {("a", str(i)): True for i in range(5)}
    timer = LookAgain(jobs, 0.2, lambda ns, name: visits.append((time.monotonic(), (ns, name))),
                      ThreadPoolExecutor(4))
    run_for(timer, 0.7)
    per_job = {key: sum(1 for _, k in visits if k == key) for key in jobs}
    # 0.7 s of a 0.2 s interval: rounds start at 0, 0.2, 0.4, 0.6 s; a loaded machine may start one late,
    # never one early (more than four would be a job visited twice in an interval).
    assert all(2 <= count <= 4 for count in per_job.values()), per_job
    first_round = sorted(t for t, _ in visits)[:5]
    assert first_round[-1] - first_round[0] >= 0.1, "the five visits are spread over the interval, not a burst"


def test_a_job_still_being_visited_is_not_queued_again_and_a_removed_one_is_left_alone():
    running, most, lock = [0], [0], threading.Lock()
    jobs = {("a", "slow"): True, ("a", "gone"): True}
    seen: list[str] = []

    def visit(namespace, name):
        seen.append(name)
        if name == "gone":
            jobs.pop(("a", "gone"), None)  # finished: out of the index
            return
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.35)  # three intervals
        with lock:
            running[0] -= 1

    run_for(LookAgain(jobs, 0.1, visit, ThreadPoolExecutor(4)), 0.8)
    assert most[0] == 1, "one visit of a job at a time"
    assert 2 <= seen.count("slow") <= 3
    assert seen.count("gone") == 1


def test_a_failed_visit_is_tried_again_next_interval(caplog):
    calls: list[str] = []

    def visit(namespace, name):
        calls.append(name)
        raise RuntimeError("the API server is away")

    run_for(LookAgain({("a", "j"): True}, 0.1, visit, ThreadPoolExecutor(1)), 0.35)
    assert len(calls) >= 2, "visited again after the failure"
    assert "looking again failed" in caplog.text and "the API server is away" in caplog.text
