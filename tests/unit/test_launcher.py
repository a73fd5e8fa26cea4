"""The node launcher: where each worker stands, and what the node's exit code says to a restart policy."""
import pytest

from kubetune_trainer.pod import node_place
from kubetune_trainer.process.launcher import NodePlace, node_exit_code, returncode_as_exit_code, worker_env


def test_a_pod_reads_its_place_from_the_training_operators_environment():
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4", "MASTER_ADDR": "job-master-0",
           "MASTER_PORT": "23456"}
    assert node_place(env) == NodePlace(processes=4, nodes=2, node_rank=1, master_addr="job-master-0",
                                        master_port=23456)


def test_trainer_v2_names_win_and_an_elastic_node_range_reads_its_maximum():
    env = {"PET_NNODES": "1:3", "PET_MASTER_ADDR": "trainjob-node-0-0.trainjob", "MASTER_ADDR": "ignored",
           "PET_MASTER_PORT": "29400", "PET_NPROC_PER_NODE": "auto"}
    place = node_place(env)
    assert (place.nodes, place.master_addr, place.master_port) == (3, "trainjob-node-0-0.trainjob", 29400)
    assert place.processes == 1, "'auto' (or anything not a number) is one process"


def test_a_pod_without_injected_environment_is_one_process():
    assert node_place({}).world_size == 1


def test_each_worker_gets_the_static_rendezvous_torchrun_would_give_it():
    place = NodePlace(processes=2, nodes=3, node_rank=2, master_addr="m", master_port=1234)
    env = worker_env({"PATH": "/bin"}, place, local_rank=1)
    assert env["RANK"] == "5" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "6"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("m", "1234")
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert worker_env({"OMP_NUM_THREADS": "8"}, place, 0)["OMP_NUM_THREADS"] == "8", "an explicit choice stays"


@pytest.mark.parametrize("stopped_from_outside,first_failure,expected,why", [
    (False, None, 0, "every worker finished"),
    (True, None, 143, "stopped before anyone failed: retryable"),
    (True, 143, 143, "the workers saved and stopped as asked"),
    (False, 143, 143, "another node asked every rank to stop: retryable"),
    (False, 1, 1, "a worker crashed: the cause, whatever the others did after"),
    (True, 1, 143, "the crash came after the stop request (a peer was already gone)"),
    (False, 137, 137, "a worker was OOM-killed"),
    (True, 2, 2, "the job itself is wrong: retrying cannot help"),
    (False, 2, 2, "the job itself is wrong"),
])
def test_the_node_exit_code_tells_the_restart_policy_why_the_node_stopped(stopped_from_outside, first_failure,
                                                                          expected, why):
    assert node_exit_code(stopped_from_outside, first_failure) == expected, why


def test_a_worker_killed_by_a_signal_reads_as_the_shells_128_plus_n():
    assert returncode_as_exit_code(-9) == 137
    assert returncode_as_exit_code(-15) == 143
    assert returncode_as_exit_code(3) == 3
