"""The Queued condition from Kueue's Workload: waiting (and why), preempted, admitted."""
from __future__ import annotations

from kubetune_operator.queueing import event_for, queue_state

NO_QUOTA = "couldn't assign flavors to pod set main: insufficient unused quota for cpu in flavor default, 1 more needed"


def workload(*conditions: tuple[str, str, str, str], cluster_queue: str | None = None) -> dict:
    status: dict = {"conditions": [{"type": t, "status": s, "reason": r, "message": m} for t, s, r, m in conditions]}
    if cluster_queue:
        status["admission"] = {"clusterQueue": cluster_queue}
    return {"status": status}


def test_a_suspended_child_without_a_workload_yet_waits_in_its_queue():
    state = queue_state("training", child_suspended=True, workload=None)
    assert (state.status, state.reason) == ("True", "Waiting")
    assert "'training'" in state.message


def test_a_running_child_without_a_workload_says_nothing():
    assert queue_state("training", child_suspended=False, workload=None) is None


def test_waiting_for_quota_gives_kueues_reason():
    state = queue_state("training", True, workload(("QuotaReserved", "False", "Pending", NO_QUOTA)))
    assert (state.status, state.reason) == ("True", "Waiting")
    assert state.message == f"waiting in queue 'training': {NO_QUOTA}"


def test_admitted_names_the_cluster_queue():
    state = queue_state("training", False, workload(("QuotaReserved", "True", "QuotaReserved", ""),
                                                    ("Admitted", "True", "Admitted", ""), cluster_queue="gpus"))
    assert (state.status, state.reason) == ("False", "Admitted")
    assert state.message == "admitted by ClusterQueue 'gpus' from queue 'training'"


def test_preempted_says_so_and_that_it_continues_from_its_checkpoint():
    why = "Preempted to accommodate a workload (UID: 1234) due to prioritization in the ClusterQueue"
    for conditions in ([("Preempted", "True", "InClusterQueue", why), ("Admitted", "False", "NoReservation", "")],
                       [("Evicted", "True", "Preempted", why), ("QuotaReserved", "False", "Pending", NO_QUOTA)]):
        state = queue_state("training", True, workload(*conditions))
        assert (state.status, state.reason) == ("True", "Preempted"), conditions
        assert why in state.message and "continues from it once Kueue readmits it" in state.message


def test_readmitted_after_a_preemption_is_admitted():
    state = queue_state("training", False, workload(("Preempted", "True", "InClusterQueue", "earlier"),
                                                    ("Admitted", "True", "Admitted", ""), cluster_queue="gpus"))
    assert state.reason == "Admitted"


def test_an_eviction_that_is_not_a_preemption_is_waiting():
    state = queue_state("training", True, workload(("Evicted", "True", "PodsReadyTimeout", "pods not ready"),
                                                   ("QuotaReserved", "False", "Pending", NO_QUOTA)))
    assert state.reason == "Waiting"


def test_a_finished_workload_says_nothing():
    assert queue_state("training", False, workload(("Finished", "True", "Succeeded", ""))) is None


def test_a_queue_that_does_not_exist_is_inadmissible_and_says_what_to_create():
    state = queue_state("trainig", True, workload(("QuotaReserved", "False", "Inadmissible",
                                                   "LocalQueue trainig doesn't exist")))
    assert (state.status, state.reason) == ("True", "Inadmissible")
    assert state.message.startswith("waiting in queue 'trainig': LocalQueue trainig doesn't exist; create a "
                                    "LocalQueue 'trainig' in this namespace")
    assert "spec.scheduling.queueName" in state.message
    assert event_for(state) == ("Warning", "Inadmissible")
    missing_cq = queue_state("training", True, workload(("QuotaReserved", "False", "Inadmissible",
                                                         "ClusterQueue gpus doesn't exist")))
    assert "create that ClusterQueue" in missing_cq.message


def test_events_announce_each_state():
    assert event_for(queue_state("q", True, None)) == ("Normal", "Queued")
    assert event_for(queue_state("q", True, workload(("Preempted", "True", "InClusterQueue", "x")))) == (
        "Warning", "Preempted")
