"""The one timer: every interval, the same reconcile for each TrainingJob whose state changes
without an event of its own (progress, Kueue's Workload, its pods, a generation Job).

Not kopf's per-object timer: kopf keeps the latest body of every object of a resource that has a
timer (to hand it to the timer), which at 5,000 TrainingJobs was most of the operator's memory
(benchmarks/RESULTS.md, "Operator latency"). Here the jobs to visit are a kopf index holding only
their names (handlers.active_jobs), and one task on kopf's loop visits them, spread over the
interval as the per-object timers were, on kopf's own thread pool. A job still being visited when
its turn comes again is skipped, so a slow API server never queues a job twice.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor

log = logging.getLogger("kubetune.operator")


class LookAgain:
    def __init__(self, jobs: Mapping, interval: float, visit: Callable[[str, str], None],
                 executor: Executor | None = None):
        self.jobs, self.interval, self.visit, self.executor = jobs, interval, visit, executor
        self.in_flight: set[tuple[str, str]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            due = list(self.jobs)  # the index changes only on this loop: a consistent snapshot
            for position, key in enumerate(due):
                if key not in self.in_flight and key in self.jobs:
                    self._start(loop, key)
                # Spread over the interval: a thousand running jobs are not read in one burst.
                await asyncio.sleep(max(0.0, started + (position + 1) * self.interval / len(due) - loop.time()))
            await asyncio.sleep(max(0.0, started + self.interval - loop.time()))

    def _start(self, loop: asyncio.AbstractEventLoop, key: tuple[str, str]) -> None:
        self.in_flight.add(key)
        visit = loop.run_in_executor(self.executor, self.visit, *key)
        visit.add_done_callback(lambda done: self._finished(key, done))

    def _finished(self, key: tuple[str, str], done: asyncio.Future) -> None:
        self.in_flight.discard(key)
        if not done.cancelled() and done.exception() is not None:
            # The next interval visits it again, as kopf's timer retried.
            log.warning("%s/%s: looking again failed (retried next interval): %s", *key, done.exception())
