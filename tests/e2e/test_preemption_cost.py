"""Preemption that costs the least work, against a real Kueue run with its PriorityBoost gate on.

Two jobs of the same priority fill a ClusterQueue: `saver` checkpoints every step, `spender` only at
its end, and `spender` is admitted second. A job of a higher priority arrives. Kueue evicts one of
the two: by itself (the chart's kueue.preemptionCost off) the most recently admitted, `spender`,
the one with all its work unsaved; with the operator keeping Kueue's priority boost from the unsaved
work (on), `saver`, whose work is all saved. Either way the evicted one checkpoints on SIGTERM,
resumes from that checkpoint once readmitted, and all three end Succeeded.

The steps at risk: the evicted job's steps after its newest regular checkpoint when it was stopped
(what a stop without the final checkpoint loses: a node lost, a save longer than the grace period).
Each run prints them (`-s`); benchmarks/RESULTS.md records both.

`make test` runs the variant `on` only: it checks that saver was admitted first, so that Kueue's own
order (the newest admitted goes first) would have picked spender; the variant `off` shows just that
order, and is the baseline of the RESULTS figures: KUBETUNE_PREEMPTION_BASELINE=1 runs it too.
"""
from __future__ import annotations

import os
import re
import time

import pytest
import yaml

from tests.e2e.conftest import install_chart, uninstall_chart
from tests.e2e.jobs import get_job, kubectl, operator_log, phase, printed_columns, rank0_pod_logs
from tests.e2e.test_kueue import (condition, priority_classes, queue, queued_job,  # noqa: F401 (fixtures)
                                  workloads)
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

BOOST = "kueue.x-k8s.io/priority-boost"
# Both start together (spender is applied as soon as saver's Workload is admitted, not once saver
# trains: a start-up takes 20-90 s here), so they train side by side; each must still train when the
# higher-priority job arrives, some 20-40 steps in (a run with saver started a whole start-up earlier
# needed 200 steps for saver).
MAX_STEPS = {"saver": 80, "spender": 80}
MARGIN = 20  # steps each still has to train when `high` is applied
SPENDER_EVERY = 1000  # only its last step
VARIANTS = ["on", "off"] if os.environ.get("KUBETUNE_PREEMPTION_BASELINE") else ["on"]


@pytest.fixture(scope="module", params=VARIANTS)
def preemption_cost(request, control_plane):
    """The operator with kueue.preemptionCost on (one boost point per second of unsaved work, rewritten
    at most every second: the jobs here run for seconds, not hours) or off; TrainJob, the default."""
    values = ["--set", "kueue.preemptionCost=true", "--set", "kueue.secondsPerBoostPoint=1",
              "--set", "kueue.boostIntervalSeconds=1"] if request.param == "on" else []
    install_chart(control_plane, "trainjob", *values)
    yield request.param
    uninstall_chart(control_plane)


def low_job(inputs: dict, name: str, every: int) -> dict:
    manifest = queued_job(inputs, name, maxSteps=MAX_STEPS[name])
    manifest["spec"]["checkpoints"]["everySteps"] = every
    manifest["spec"]["scheduling"]["workloadPriorityClass"] = "e2e-low"
    return manifest


def test_kueue_preempts_the_job_that_loses_least_when_the_operator_boosts_unsaved_work(
        control_plane, api_client, core, preemption_cost, job_namespace, inputs_in_s3, queue, priority_classes):
    """Over a minute: three jobs (two side by side, then a higher priority one) and the evicted one's resume."""
    queue(cpus=2, preemption={"withinClusterQueue": "LowerPriority"})
    ns = job_namespace

    def status(name: str) -> dict:
        return get_job(api_client, ns, name).get("status") or {}

    def step_of(name: str) -> int:
        return (status(name).get("progress") or {}).get("step", 0)

    def log() -> str:
        return operator_log(control_plane, core)

    def reserved_at(name: str) -> str | None:
        found = workloads(api_client, ns).get(name)
        reserved = condition(found, "QuotaReserved") if found else None
        return reserved["lastTransitionTime"] if reserved and reserved["status"] == "True" else None

    # saver first (admitted first), then spender: without the boost Kueue evicts the newest, spender.
    # Kueue compares admission times in whole seconds: spender is applied in the next second at least.
    for name, every in (("saver", 1), ("spender", SPENDER_EVERY)):
        kubectl(control_plane, "apply", "-n", ns, "-f", "-", input=yaml.safe_dump(low_job(inputs_in_s3, name, every)))
        eventually(lambda: reserved_at(name), timeout=120, interval=0.2,
                   message=lambda: f"{name} admitted; operator log:\n{log()}")
        time.sleep(1.1)
    assert reserved_at("saver") < reserved_at("spender"), (reserved_at("saver"), reserved_at("spender"))
    for name in ("saver", "spender"):
        eventually(lambda: step_of(name) >= 2, timeout=400, interval=0.5,
                   message=lambda: f"{name} trains; operator log:\n{log()}")

    # Both report their saved and unsaved work; kubectl shows it.
    eventually(lambda: (status("spender").get("unsavedWork") or {}).get("seconds", 0) >= 4
               and step_of("spender") >= 6, timeout=300, interval=0.5,
               message=lambda: f"spender's unsaved work shown; {status('spender')}")
    unsaved = status("spender")["unsavedWork"]
    assert unsaved["steps"] >= 1 and "lastCheckpoint" not in status("spender"), status("spender")
    saver = status("saver")
    assert saver["lastCheckpoint"]["step"] >= 1 and saver["lastCheckpoint"]["time"], saver
    assert saver["unsavedWork"]["steps"] < unsaved["steps"], (saver, unsaved)
    lines = kubectl(control_plane, "get", "tj", "-n", ns).stdout.splitlines()
    rows = {row["NAME"]: row for row in (printed_columns(lines[0], line) for line in lines[1:])}
    assert int(rows["spender"]["UNSAVED"]) >= 1, lines

    if preemption_cost == "on":
        # The operator keeps the boost on each Workload; spender's is the larger.
        def boosts() -> dict[str, int]:
            found = workloads(api_client, ns)
            return {n: int((found[n]["metadata"].get("annotations") or {}).get(BOOST, "0")) for n in ("saver", "spender")}
        eventually(lambda: boosts()["spender"] >= 3 and boosts()["spender"] > boosts()["saver"], timeout=60,
                   interval=0.5, message=lambda: f"spender boosted above saver {boosts()}; operator log:\n{log()}")
        assert status("spender")["priorityBoost"] >= 1
    else:
        found = workloads(api_client, ns)
        assert all(BOOST not in (w["metadata"].get("annotations") or {}) for w in found.values()), found

    # A job of a higher priority arrives at the full queue: Kueue evicts one of the two (both still train).
    for name in ("saver", "spender"):
        assert step_of(name) < MAX_STEPS[name] - MARGIN and phase(api_client, ns, name) == "Running", status(name)
    high = queued_job(inputs_in_s3, "high", maxSteps=4)
    high["spec"]["scheduling"]["workloadPriorityClass"] = "e2e-high"
    kubectl(control_plane, "apply", "-n", ns, "-f", "-", input=yaml.safe_dump(high))
    evicted = eventually(lambda: next((n for n, w in workloads(api_client, ns).items() if n != "high"
                                       and (condition(w, "Preempted") or {}).get("status") == "True"), None),
                         timeout=180, interval=0.5, message=lambda: f"one preempted; operator log:\n{log()}")
    expected = "saver" if preemption_cost == "on" else "spender"
    assert evicted == expected, (evicted, {n: w["metadata"].get("annotations") for n, w in workloads(api_client, ns).items()})
    if preemption_cost == "on":  # no boost left on it while it waits
        eventually(lambda: BOOST not in (workloads(api_client, ns)[evicted]["metadata"].get("annotations") or {}),
                   timeout=60, interval=0.5, message="the evicted job's boost removed")

    for name in ("high", "saver", "spender"):
        eventually(lambda: phase(api_client, ns, name) in ("Succeeded", "Failed"), timeout=900, interval=2,
                   message=lambda: f"{name} finished; operator log:\n{log()}")
    assert {n: phase(api_client, ns, n) for n in ("high", "saver", "spender")} == dict.fromkeys(
        ("high", "saver", "spender"), "Succeeded")
    assert step_of(evicted) == MAX_STEPS[evicted] and "unsavedWork" not in status(evicted)

    # The evicted pod took a last checkpoint on SIGTERM; its successor resumed there.
    logs = rank0_pod_logs(control_plane, "trainjob", ns, evicted)
    assert len(logs) == 2, [text[-500:] for text in logs]
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", logs[0])
    resumed = re.search(r"resumed from (\S+) at step (\d+)", logs[1])
    assert stopped and resumed, (logs[0][-2000:], logs[1][-2000:])
    at = int(stopped.group(1))
    assert int(resumed.group(2)) == at, "nothing trained twice"
    every = 1 if evicted == "saver" else SPENDER_EVERY
    at_risk = at - (at // every) * every
    print(f"\npreemption cost {preemption_cost}: evicted {evicted} at step {at}, {at_risk} step(s) after its newest "
          f"regular checkpoint (lost without the SIGTERM checkpoint), {at - int(resumed.group(2))} trained twice")
