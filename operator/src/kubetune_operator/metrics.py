"""The operator's Prometheus metrics (prefix kubetune_operator_), served by __main__."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter("kubetune_operator_reconciles_total",
                     "TrainingJob reconciliations, by result (ok, retry, error).", ["result"])
RECONCILE_SECONDS = Histogram("kubetune_operator_reconcile_duration_seconds",
                              "Time to reconcile one TrainingJob.")
CHILD_JOBS_CREATED = Counter("kubetune_operator_child_jobs_created_total",
                             "Child training jobs created, by kind.", ["kind"])
