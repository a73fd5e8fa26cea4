"""How many CPU threads each trainer process of a pod takes when nobody set OMP_NUM_THREADS."""
import pytest

from kubetune_trainer.process.cpu_threads import cpu_allowance, thread_env, threads_per_process

REQUEST, LIMIT = "KUBETUNE_CPU_REQUEST_MILLICORES", "KUBETUNE_CPU_LIMIT_MILLICORES"


@pytest.mark.parametrize("env,visible,allowance", [
    ({}, 16, 16),                                      # outside a pod: the cores it sees
    ({REQUEST: "2000", LIMIT: "64000"}, 64, 2),        # request only: the limit reads as the node's allocatable
    ({REQUEST: "4000", LIMIT: "4000"}, 64, 4),         # spec.resources.cpu: request = limit
    ({REQUEST: "0", LIMIT: "3500"}, 64, 3.5),          # a request never set reads as 0
    ({REQUEST: "8000", LIMIT: "8000"}, 2, 2),          # never more than the cores it can run on
    ({REQUEST: "lots", LIMIT: ""}, 8, 8),              # unreadable: ignored
])
def test_a_pod_counts_on_the_least_of_its_request_limit_and_visible_cores(env, visible, allowance):
    assert cpu_allowance(env, visible) == allowance


@pytest.mark.parametrize("allowance,processes,threads", [(16, 1, 16), (16, 4, 4), (3.5, 2, 1), (2, 8, 1), (0.5, 1, 1)])
def test_the_allowance_is_split_evenly_in_whole_threads_never_below_one(allowance, processes, threads):
    assert threads_per_process(allowance, processes) == threads


def test_the_users_omp_num_threads_wins():
    assert thread_env({"OMP_NUM_THREADS": "6", REQUEST: "1000"}, processes=1, visible_cores=8) == {}
    assert thread_env({REQUEST: "1000"}, processes=1, visible_cores=8) == {"OMP_NUM_THREADS": "1"}
    assert thread_env({REQUEST: "8000"}, processes=2, visible_cores=8) == {"OMP_NUM_THREADS": "4"}


def test_a_pods_entry_point_gives_each_of_its_trainers_their_share(example_manifest, tmp_path, monkeypatch):
    """The wiring for several processes: the pod entry → launcher → each worker's environment, on an
    8-core node with a 4-CPU request split between two trainer processes."""
    import yaml

    from kubetune_trainer import pod
    from kubetune_trainer.process.launcher import worker_env

    config = tmp_path / "job.yaml"
    example_manifest["spec"]["model"]["pretrained"] = "s3://models/sd15"  # a hub id would start the models stage
    config.write_text(yaml.safe_dump(example_manifest))
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset for thread_env, and restored after the test
    for name, value in {REQUEST: "4000", LIMIT: "64000", "PET_NNODES": "1", "PET_NODE_RANK": "0",
                        "PET_NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(pod.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    launched = []
    monkeypatch.setattr(pod, "launch", lambda command, place: launched.append(place) or 0)
    with pytest.raises(SystemExit):
        pod.main(["--config", str(config)])
    (place,) = launched
    assert [worker_env(dict(pod.os.environ), place, rank)["OMP_NUM_THREADS"] for rank in (0, 1)] == ["2", "2"]
