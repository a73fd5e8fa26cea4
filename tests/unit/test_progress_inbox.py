"""The operator's progress inbox: rank 0 pushes its gauges, nobody else may, stale pushes fall back to the poll."""
from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from contextlib import contextmanager

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest

from kubetune_api.contract import TrainerEnv, final_report, progress_path
from kubetune_operator.pod_template import static_env
from kubetune_operator import metrics
from kubetune_operator.progress_inbox import MAX_BODY_BYTES, ProgressInbox
from kubetune_operator.settings import Settings

INTERVAL = 10.0
GAUGES = {"step": 7.0, "planned_steps": 20.0, "loss": 0.25}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def push(inbox: ProgressInbox, body, namespace: str = "team", job: str = "sd15") -> int:
    """POST BODY to the inbox from 127.0.0.1 (the test client's address); the HTTP status."""
    async def post() -> int:
        async with TestClient(TestServer(inbox.app())) as client:
            response = await client.post(progress_path(namespace, job), data=body)
            return response.status
    return asyncio.run(post())


def test_a_push_from_the_jobs_rank0_pod_is_kept_and_looked_up_once():
    lookups = []
    inbox = ProgressInbox(lambda ns, job: lookups.append((ns, job)) or {"127.0.0.1"}, INTERVAL, clock=Clock())
    assert push(inbox, final_report(GAUGES)) == 204
    assert inbox.fresh("team", "sd15") == GAUGES
    assert push(inbox, final_report({**GAUGES, "step": 8.0})) == 204
    assert inbox.fresh("team", "sd15")["step"] == 8.0
    assert lookups == [("team", "sd15")]  # the pod's address is remembered, not listed per push
    assert inbox.fresh("team", "other") is None
    inbox.forget("team", "sd15")  # the job deleted
    assert inbox.fresh("team", "sd15") is None


def test_a_push_from_another_address_is_refused_with_403():
    lookups = []
    inbox = ProgressInbox(lambda ns, job: lookups.append(job) or {"127.0.0.2"}, INTERVAL, clock=Clock())
    assert push(inbox, final_report(GAUGES)) == 403
    assert push(inbox, final_report(GAUGES)) == 403
    assert inbox.fresh("team", "sd15") is None
    assert lookups == ["sd15"]  # a stranger's pushes cost one lookup per interval, not one each


def test_a_push_older_than_two_intervals_falls_back_to_the_poll():
    clock = Clock()
    inbox = ProgressInbox(lambda ns, job: {"127.0.0.1"}, INTERVAL, clock=clock)
    assert push(inbox, final_report(GAUGES)) == 204
    clock.now += 2 * INTERVAL
    assert inbox.fresh("team", "sd15") == GAUGES
    clock.now += 1
    assert inbox.fresh("team", "sd15") is None


def test_a_body_that_is_not_a_report_is_refused_with_400():
    inbox = ProgressInbox(lambda ns, job: {"127.0.0.1"}, INTERVAL, clock=Clock())
    assert push(inbox, "step 7") == 400
    assert inbox.fresh("team", "sd15") is None


def pushes_counted() -> dict[str, float]:
    from prometheus_client import REGISTRY

    return {outcome: REGISTRY.get_sample_value("kubetune_operator_progress_pushes_total", {"outcome": outcome})
            for outcome in metrics.PROGRESS_PUSH_OUTCOMES}


def test_every_answer_is_counted_by_its_outcome_and_only_those_labels_exist():
    before = pushes_counted()
    assert None not in before.values(), "each outcome is exported from the start"
    rank0 = ProgressInbox(lambda ns, job: {"127.0.0.1"}, INTERVAL, clock=Clock())
    stranger = ProgressInbox(lambda ns, job: {"127.0.0.2"}, INTERVAL, clock=Clock())
    assert push(rank0, final_report(GAUGES)) == 204
    assert push(rank0, final_report(GAUGES), job="other") == 204
    assert push(stranger, final_report(GAUGES)) == 403
    assert push(rank0, "step 7") == 400
    assert push(rank0, "x" * (MAX_BODY_BYTES + 1)) == 413
    assert push(rank0, chunked("x" * (MAX_BODY_BYTES + 1))) == 413  # no Content-Length: found while read
    after = pushes_counted()
    assert {o: after[o] - before[o] for o in after} == {"accepted": 2, "not_rank0": 1, "bad_report": 1,
                                                        "too_large": 2}
    exposition = generate_latest().decode()
    labels = set(re.findall(r'kubetune_operator_progress_pushes_total\{outcome="([^"]+)"\}', exposition))
    assert labels == set(metrics.PROGRESS_PUSH_OUTCOMES), "never a job's name or an address"


async def _chunks(text: str):
    for start in range(0, len(text), 4096):
        yield text[start:start + 4096].encode()


def chunked(text: str):
    """TEXT as a body sent in chunks, without a Content-Length."""
    return _chunks(text)


def test_trainers_are_told_where_to_push_only_where_an_inbox_runs():
    def pushed(settings: Settings) -> TrainerEnv:
        return TrainerEnv.from_env({e["name"]: e["value"] for e in static_env(settings) if "value" in e})

    url = "http://kubetune-operator.kubetune.svc:9401"
    on = pushed(Settings(progress_url=url, progress_inbox_address="0.0.0.0", progress_interval_seconds=5))
    assert (on.progress_url, on.progress_interval_seconds) == (url, 5.0)
    off = pushed(Settings(progress_url=url))
    assert (off.progress_url, off.progress_interval_seconds) == (None, None)


@contextmanager
def serving(inbox: ProgressInbox):
    """INBOX served on 127.0.0.1 from a thread of its own (as on kopf's loop); yields its port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(inbox.serve("127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_the_trainers_pusher_reaches_the_inbox_and_a_failing_push_is_logged_once(caplog):
    from kubetune_trainer.telemetry.progress_push import ProgressPusher

    inbox = ProgressInbox(lambda ns, job: {"127.0.0.7"}, INTERVAL)  # the pod's own address, as in a pod
    with serving(inbox) as port:
        url = f"http://127.0.0.1:{port}{progress_path('team', 'sd15')}"
        assert not ProgressPusher(url, INTERVAL, lambda: GAUGES).push(), "from 127.0.0.1: refused (403)"
        pusher = ProgressPusher(url, INTERVAL, lambda: GAUGES, source_address="127.0.0.7")
        assert pusher.push()
        assert inbox.fresh("team", "sd15") == GAUGES
    assert not pusher.push() and not pusher.push()  # the inbox is gone: the operator polls instead
    assert sum("progress push" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records) == 2


def test_the_reconcile_reads_a_fresh_push_and_polls_when_it_is_stale(monkeypatch):
    from kubetune_operator import progress_inbox, reconcile

    clock = Clock()
    inbox = ProgressInbox(lambda ns, job: {"127.0.0.1"}, INTERVAL, clock=clock)
    monkeypatch.setattr(progress_inbox, "INBOX", inbox)
    polled = []
    monkeypatch.setattr(reconcile, "_gauges", lambda ns, job, backend, settings: polled.append(job) or {"step": 3.0})
    assert push(inbox, final_report(GAUGES)) == 204
    assert reconcile.progress("team", "sd15", None, Settings()) == GAUGES
    assert polled == []
    clock.now += 2 * INTERVAL + 1
    assert reconcile.progress("team", "sd15", None, Settings()) == {"step": 3.0}
    assert polled == ["sd15"]


def test_a_finishing_trainer_pushes_its_final_gauges_instead_of_waiting_for_a_read(monkeypatch):
    from kubetune_trainer.telemetry.reporting import Reporter

    inbox = ProgressInbox(lambda ns, job: {"127.0.0.7"}, INTERVAL)
    with serving(inbox) as port:
        for field, value in (("progress_url", f"http://127.0.0.1:{port}"), ("progress_interval_seconds", "3600"),
                             ("metrics_addr", "127.0.0.7"), ("metrics_port", "0")):
            monkeypatch.setenv(TrainerEnv.NAMES[field], value)
        reporter = Reporter(True, total_steps=10, start_step=0, log_dir=None, log_every=1, samples_per_step=4,
                            namespace="team", job_name="sd15")
        try:
            reporter.step(10, loss=0.25, lr=1e-4, epoch=0)
            started = time.perf_counter()
            reporter.await_final_read(30.0)
            assert time.perf_counter() - started < 5, "no wait for a read the operator will not make"
            pushed = inbox.fresh("team", "sd15")
            assert (pushed["step"], pushed["planned_steps"], pushed["loss"]) == (10, 10, 0.25)
        finally:
            reporter.close()
            reporter.metrics.server.close()
