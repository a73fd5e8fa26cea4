"""The progress inbox: running trainers push their progress here instead of being polled.

Each running job's rank 0 POSTs its gauges (contract.final_report's JSON) to
`POST /progress/<namespace>/<job>` once per interval (TrainerEnv.progress_url); the reconcile takes
the newest ones from here while they are fresh (two intervals) and falls back to reading the
trainer's /metrics otherwise (an older trainer, the first interval after an operator restart).
Measured at 1,000 running jobs (benchmarks/progress_scale.py, RESULTS.md): this inbox 0.47 ms of
operator CPU per job per interval, the poll 3.41 ms (its GET 2.76 ms and its pod LIST 0.65 ms).

A push is accepted only from the address of that job's rank-0 pod: any pod could otherwise write
any job's progress. The address is looked up once (the rank-0 pods' LIST the poll does per
interval) and kept until a push comes from another address, which is looked up again, at most once
per interval per job, so a stranger's pushes cannot make the operator LIST pods in a loop. Each
answer is counted by outcome (kubetune_operator_progress_pushes_total): refusals are how an admin
sees that pushes never arrive, e.g. behind a service mesh that rewrites the pods' source addresses.

The server runs on kopf's event loop (handlers.configure starts it); the reconcile, in kopf's
threads, reads with `fresh()`: a dict read under the GIL, no lock needed for one assignment.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from kubetune_api.contract import PROGRESS_PATH, read_final_report
from kubetune_operator import metrics

log = logging.getLogger("kubetune.operator")

# A report is a dozen numbers; anything far larger is not one.
MAX_BODY_BYTES = 16 * 1024


@dataclass(frozen=True)
class Received:
    gauges: dict[str, float]
    at: float  # time.monotonic() when it came


class ProgressInbox:
    """The newest pushed gauges per job, and who may push them.

    RANK0_ADDRESSES(namespace, job) answers the addresses of the job's running rank-0 pods (called in
    a thread: it asks the API server); INTERVAL is the progress interval in seconds.
    """

    def __init__(self, rank0_addresses: Callable[[str, str], set[str]], interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rank0_addresses = rank0_addresses
        self._interval = interval
        self._clock = clock
        self._received: dict[tuple[str, str], Received] = {}
        self._allowed: dict[tuple[str, str], set[str]] = {}
        self._looked_up_at: dict[tuple[str, str], float] = {}

    def fresh(self, namespace: str, job: str) -> dict[str, float] | None:
        """The job's newest pushed gauges if they came within two intervals, else None (poll)."""
        received = self._received.get((namespace, job))
        if received is None or self._clock() - received.at > 2 * self._interval:
            return None
        return received.gauges

    def forget(self, namespace: str, job: str) -> None:
        for kept in (self._received, self._allowed, self._looked_up_at):
            kept.pop((namespace, job), None)

    async def _may_push(self, key: tuple[str, str], address: str | None) -> bool:
        if address is None:
            return False
        if address in self._allowed.get(key, ()):
            return True
        now = self._clock()
        if now - self._looked_up_at.get(key, float("-inf")) < self._interval:
            return False  # looked up recently: a stranger, or a new pod's next push will do
        self._looked_up_at[key] = now
        addresses = await asyncio.get_running_loop().run_in_executor(None, self._rank0_addresses, *key)
        self._allowed[key] = set(addresses)
        return address in self._allowed[key]

    async def handle(self, request: web.Request) -> web.Response:
        outcome, response = await self._answer(request)
        metrics.PROGRESS_PUSHES.labels(outcome).inc()
        return response

    async def _answer(self, request: web.Request) -> tuple[str, web.Response]:
        """(the outcome counted in metrics.PROGRESS_PUSHES, the response) of one push."""
        key = (request.match_info["namespace"], request.match_info["job"])
        if not await self._may_push(key, request.remote):
            log.debug("progress push for %s/%s refused from %s", *key, request.remote)
            return "not_rank0", web.Response(status=403,
                                             text=f"{request.remote} is not the rank-0 pod of {key[0]}/{key[1]}\n")
        too_large = web.Response(status=413, text="a progress report is at most 16 KiB\n")
        if (request.content_length or 0) > MAX_BODY_BYTES:
            return "too_large", too_large
        try:
            body = await request.text()
        except web.HTTPRequestEntityTooLarge:  # a body sent without its length, found larger while read
            return "too_large", too_large
        gauges = read_final_report(body)
        if gauges is None:
            return "bad_report", web.Response(status=400,
                                              text="the body is not a progress report (contract.final_report)\n")
        self._received[key] = Received(gauges, self._clock())
        return "accepted", web.Response(status=204)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(PROGRESS_PATH + "/{namespace}/{job}", self.handle)
        return app

    async def serve(self, address: str, port: int) -> web.AppRunner:
        """Start serving on ADDRESS:PORT on the running loop; the runner stops it (`cleanup()`)."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, address, port).start()
        self.runner = runner  # held for as long as the operator runs
        log.info("progress inbox on %s:%d", address, port)
        return runner


# The operator's one inbox, set by handlers.configure when the settings give it an address.
INBOX: ProgressInbox | None = None


def fresh(namespace: str, job: str) -> dict[str, float] | None:
    """The job's pushed gauges when an inbox runs and they are fresh; else None."""
    return INBOX.fresh(namespace, job) if INBOX is not None else None
