"""Preemption that costs the least work: Kueue's priority boost from a job's unsaved work (pure).

When Kueue must preempt, it orders the candidates by priority, then by admission time (the newest
goes first): it cannot know that one job wrote a checkpoint a minute ago and another has an hour of
unsaved work. Kueue v0.17+ with its `PriorityBoost` feature gate (alpha, KEP-7990) reads the
annotation `kueue.x-k8s.io/priority-boost` on a Workload, a signed integer, and uses
priority + boost (the effective priority) wherever it used the priority within a ClusterQueue: the
order of the queue's heads, the order of preemption candidates, and whether a job may preempt
another (`LowerPriority`: the preemptor's effective priority must be higher; v0.19's
pkg/util/priority/priority.go and pkg/scheduler/preemption/common).

With the chart's kueue.preemptionCost, the operator keeps on each running job's Workload

    boost = min(maxBoost, unsaved seconds // secondsPerPoint)        (0 while not admitted and running)

The bound: boost is never negative and at most maxBoost, which must stay below the smallest gap
between the values of the priority classes in use (default 99: classes 100 apart, as Kueue's own
low=100 / mid=200 / high=300 example). Then a job of class P has an effective priority in
[P, P + maxBoost] < Q for every higher class Q: every job of a higher class still preempts it and
is still ordered before it, and it can never preempt one; a job of a lower class can never reach it.
Only jobs of one class are reordered among themselves: the one with the least unsaved work is
preempted first. (A boost may cross class boundaries in Kueue; this one must not.)

Writes are few: a change is written at most once per intervalSeconds per job, except going back to
0 when the job stops running (a preempted job keeps no boost in the queue, where it would be
ordered, or preempt, ahead of its peers). Ownership: beside Kueue's annotation the operator records
what it wrote (RECORD_ANNOTATION, JSON {"boost", "at"}); a boost annotation that does not match
that record was set by someone else, and is kept as it is (the PriorityBoost condition and a
Warning event say so).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kubetune_api.contract import API_GROUP
from kubetune_operator import queueing
from kubetune_operator.timestamps import unix_seconds

BOOST_ANNOTATION = "kueue.x-k8s.io/priority-boost"  # Kueue's (KEP-7990)
RECORD_ANNOTATION = f"{API_GROUP}/priority-boost"  # what kubetune wrote there, and when
CONDITION = "PriorityBoost"


@dataclass(frozen=True)
class BoostSettings:
    """The chart's kueue.preemptionCost values."""

    enabled: bool = False
    max_boost: int = 99
    seconds_per_point: float = 60.0
    interval_seconds: float = 60.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "BoostSettings":
        env = os.environ if env is None else env

        def number(name: str, default, kind, value: str, low) -> float:
            raw = env.get(name) or str(default)
            try:
                parsed = kind(raw)
            except ValueError:
                parsed = None
            if parsed is None or parsed < low:
                raise ValueError(f"{name} (Helm value kueue.{value}) is {raw!r}; use a number of at least {low}")
            return parsed

        return cls(enabled=env.get("KUBETUNE_KUEUE_PREEMPTION_COST", "").lower() == "true",
                   max_boost=number("KUBETUNE_KUEUE_MAX_PRIORITY_BOOST", cls.max_boost, int, "maxPriorityBoost", 1),
                   seconds_per_point=number("KUBETUNE_KUEUE_SECONDS_PER_BOOST_POINT", cls.seconds_per_point, float,
                                            "secondsPerBoostPoint", 1),
                   interval_seconds=number("KUBETUNE_KUEUE_BOOST_INTERVAL_SECONDS", cls.interval_seconds, float,
                                           "boostIntervalSeconds", 0))


def boost_for(unsaved_seconds: float, settings: BoostSettings) -> int:
    """The boost for this much unsaved work: one point per secondsPerPoint, at most maxBoost."""
    return max(0, min(settings.max_boost, int(unsaved_seconds // settings.seconds_per_point)))


@dataclass(frozen=True)
class BoostPlan:
    patch: dict | None = None  # a merge patch of the Workload's annotations; None: nothing to write now
    boost: int | None = None  # the boost kubetune keeps there (after the patch); None: not kubetune's
    foreign: str | None = None  # someone else's boost, kept as it is


def _record(annotations: dict) -> dict | None:
    try:
        record = json.loads(annotations.get(RECORD_ANNOTATION) or "null")
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("boost"), int) else None


def plan(workload: dict, unsaved_seconds: float | None, now: str, settings: BoostSettings) -> BoostPlan:
    """What to write on WORKLOAD for a job with UNSAVED_SECONDS of work at risk (None: not running)."""
    annotations = dict((workload.get("metadata") or {}).get("annotations") or {})
    found, record = annotations.get(BOOST_ANNOTATION), _record(annotations)
    if found is not None and (record is None or str(record["boost"]) != found):
        return BoostPlan(foreign=found)
    if queueing.is_finished(workload):
        return BoostPlan(boost=int(found) if found is not None else 0)  # no longer ordered: no write
    running = unsaved_seconds is not None and queueing.is_admitted(workload)
    wanted = boost_for(unsaved_seconds, settings) if running else 0
    written = int(found) if found is not None else 0
    if wanted == written:
        return BoostPlan(boost=written)
    recent = record is not None and unix_seconds(now) - unix_seconds(record.get("at") or now) < settings.interval_seconds
    if running and recent:
        return BoostPlan(boost=written)  # changed again soon: at most one write per interval
    return BoostPlan(patch={"metadata": {"annotations": {
        BOOST_ANNOTATION: str(wanted) if wanted else None,
        RECORD_ANNOTATION: json.dumps({"boost": wanted, "at": now}, separators=(",", ":"))}}}, boost=wanted)


def foreign_message(found: str) -> str:
    return (f"the Kueue Workload's {BOOST_ANNOTATION} is {found!r}, set by someone else: kubetune keeps it and does "
            f"not boost this job for its unsaved work; remove the annotation to let kubetune manage it")
