"""The operator's Prometheus metrics (prefix kubetune_operator_), served by __main__.

Every label has a small fixed set of values, and each is exported from the start (at 0), so a
dashboard or an alert sees a series before the first event rather than "no data".
"""
from __future__ import annotations

import threading
from typing import Iterable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kubetune_operator.status import PHASES

RECONCILE_RESULTS = ("ok", "retry", "error")
# Why the admission webhook refused a TrainingJob: the typed model refused the spec, the S3
# credentials Secret it names is not there, or its backend cannot honour a field it sets.
# volume_refused: a volume the job's namespace's Pod Security Standard forbids (volume_policy.py).
# invalid_sweep: a TrainingSweep the typed model refused (a parameter, the objective, the template).
ADMISSION_REASONS = ("invalid_spec", "queue", "backend", "image_not_allowed", "volume_refused", "invalid_sweep")
# What the progress inbox (progress_inbox.py) answered a trainer's push: kept (204), refused because
# it did not come from the job's running rank-0 pod address (403), not a report (400), too large (413).
PROGRESS_PUSH_OUTCOMES = ("accepted", "not_rank0", "bad_report", "too_large")

RECONCILES = Counter("kubetune_operator_reconciles_total",
                     "TrainingJob reconciliations, by result (ok, retry, error).", ["result"])
RECONCILE_SECONDS = Histogram("kubetune_operator_reconcile_duration_seconds",
                              "Time to reconcile one TrainingJob.")
SWEEP_RECONCILE_SECONDS = Histogram("kubetune_operator_sweep_reconcile_duration_seconds",
                                    "Time of one step of a TrainingSweep: read its trials, decide, create and record.")
CHILD_JOBS_CREATED = Counter("kubetune_operator_child_jobs_created_total",
                             "Child training jobs created, by kind.", ["kind"])
ADMISSION_REJECTIONS = Counter("kubetune_operator_admission_rejections_total",
                               "TrainingJobs and TrainingSweeps the admission webhook refused, by reason "
                               f"({', '.join(ADMISSION_REASONS)}).", ["reason"])
# Refused pushes cost nothing but the push (the operator polls that job instead); a not_rank0 rate
# that matches the accepted one of a healthy cluster means a service mesh or NAT rewrites the
# trainers' source addresses (README, "Metrics and dashboards").
PROGRESS_PUSHES = Counter("kubetune_operator_progress_pushes_total",
                          "Progress reports trainers pushed to the operator's inbox, by outcome "
                          f"({', '.join(PROGRESS_PUSH_OUTCOMES)}).", ["outcome"])
# When the certificate the webhook serves expires (webhook.py keeps it fresh; an alert on
# `kubetune_operator_webhook_certificate_expiry_timestamp_seconds - time() < 86400` catches a keeper that stopped).
WEBHOOK_CERTIFICATE_EXPIRY = Gauge("kubetune_operator_webhook_certificate_expiry_timestamp_seconds",
                                   "When the admission webhook's serving certificate expires (Unix time).")
# The operator's own requests to the API server, through kube.py's clients (kopf's watches, its
# finalizer and annotation patches and the events it posts go through kopf's client, not counted):
# how many a reconcile costs, and how long a busy API server makes each wait.
API_REQUEST_SECONDS = Histogram("kubetune_operator_api_request_duration_seconds",
                                "The operator's requests to the API server, by verb and resource.",
                                ["verb", "resource"])
for _result in RECONCILE_RESULTS:
    RECONCILES.labels(_result)
for _reason in ADMISSION_REASONS:
    ADMISSION_REJECTIONS.labels(_reason)
for _outcome in PROGRESS_PUSH_OUTCOMES:
    PROGRESS_PUSHES.labels(_outcome)


class PhaseCounts(Collector):
    """kubetune_operator_trainingjobs{phase}: the TrainingJobs that exist now, by status.phase.

    A count, not increments: a handler (handlers.count_by_phase) records the phase of every
    object kopf's watch delivers, keyed by UID, and the gauge is counted from that map at each
    scrape. So a phase change replaces an entry instead of moving a +1/-1 that a missed event
    would leave wrong for good, and a restarted operator starts empty and is refilled by kopf's
    initial listing (every existing object arrives as an event), not from a lost in-memory total.

    A job leaves the count on its DELETED event (or as soon as its deletion starts, where something
    else holds a finalizer on it). TrainingJobs carry no finalizer of the operator's (deleting one,
    or its namespace, never waits for the operator), so a job deleted while the operator's watch
    was away and had to list again (HTTP 410) stays counted until the operator restarts: kopf
    reports no deletion for what a new listing merely lacks. A job without a phase yet is waiting
    for its first reconcile, i.e. Pending.
    """

    NAME = "kubetune_operator_trainingjobs"
    HELP = f"TrainingJobs by status.phase ({', '.join(PHASES)})."

    def __init__(self) -> None:
        self._phases: dict[str, str] = {}
        self._lock = threading.Lock()  # handlers run in kopf's thread pool, scrapes in the server's thread

    def observe(self, uid: str, phase: str | None, deleting: bool = False) -> None:
        with self._lock:
            if deleting:
                self._phases.pop(uid, None)
            elif phase in PHASES or phase is None:
                self._phases[uid] = phase or "Pending"

    def counts(self) -> dict[str, int]:
        with self._lock:
            phases = list(self._phases.values())
        return {phase: phases.count(phase) for phase in PHASES}

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=["phase"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["phase"])
        for phase, count in self.counts().items():
            family.add_metric([phase], count)
        yield family


TRAININGJOBS = PhaseCounts()
REGISTRY.register(TRAININGJOBS)
