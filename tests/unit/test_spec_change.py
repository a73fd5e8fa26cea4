"""Changing a started TrainingJob: suspend at any time, the size while no pod runs, nothing else
(kubetune_operator.spec_change, the decision the reconcile applies through spec_change.against_applied)."""
import copy

import pytest

from kubetune_api.manifest import parse_manifest
from kubetune_operator.backends import PyTorchJobBackend
from kubetune_operator.settings import Settings
from kubetune_operator.spec_change import Size, changed_paths, decide, with_size
from kubetune_operator.trainer_config import build_config_map, job_from_config_map

SETTINGS = Settings(trainer_image="registry.example/kubetune/trainer:1.2")
UID = "0d7f7c1e-5a55-4a4e-9a1b-2a7b0f3c9e11"


@pytest.fixture
def cpu_job(example_manifest):
    """The example as a 2-node x 2-process CPU job: (manifest, spec dict)."""
    manifest = copy.deepcopy(example_manifest)
    manifest["metadata"]["namespace"] = "team-a"
    manifest["spec"]["training"]["mixedPrecision"] = "no"
    manifest["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 0}
    manifest["spec"]["distributed"] = {"processesPerNode": 2}
    return manifest


def changed(spec: dict, **changes) -> dict:
    """SPEC with `resources__nodes=1`-style changes; None deletes the field."""
    spec = copy.deepcopy(spec)
    for dotted, value in changes.items():
        node = spec
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return spec


# (what the old spec had, what the new one has, child suspended) -> suspend, new size, or refused with words
CASES = [
    ("suspend a running job", dict(), dict(suspend=True), False, True, None, None),
    ("resume a suspended job", dict(suspend=True), dict(suspend=False), True, False, None, None),
    ("resize a suspended job", dict(suspend=True), dict(suspend=True, resources__nodes=1), True,
     None, (1, 2), None),
    ("resize and resume in one apply", dict(suspend=True), dict(suspend=False, resources__nodes=1), True,
     False, (1, 2), None),
    ("suspend and resize in one apply", dict(), dict(suspend=True, distributed__processesPerNode=1), False,
     True, (2, 1), None),
    ("grow a suspended job", dict(suspend=True), dict(suspend=True, resources__nodes=4,
                                                      distributed__processesPerNode=3), True, None, (4, 3), None),
    ("processesPerNode removed: one process per CPU pod", dict(suspend=True),
     dict(suspend=True, distributed__processesPerNode=None), True, None, (2, 1), None),
    ("a job Kueue holds suspended (spec.suspend false) may be resized", dict(), dict(resources__nodes=1), True,
     None, (1, 2), None),
    ("resize a running job", dict(), dict(resources__nodes=1), False, None, None,
     "changed from 2x2 processes to 1x2 processes while it runs; suspend first"),
    ("resize while resuming a child that is not suspended", dict(suspend=True),
     dict(suspend=False, resources__nodes=1), False, None, None, "suspend first"),
    ("change the rank of a suspended job", dict(suspend=True), dict(suspend=True, adapter__rank=32), True,
     None, None, "spec.adapter.rank changed after the run started"),
    ("resize with another change: both refused", dict(suspend=True),
     dict(suspend=True, resources__nodes=1, training__learningRate=1.0), True,
     None, None, "spec.training.learningRate changed after the run started"),
    ("writing out a default is no change", dict(), dict(adapter__dropout=0.0), False, None, None, None),
    ("an invalid new spec", dict(suspend=True), dict(suspend=True, resources__nodes=0), True,
     None, None, "the new spec is invalid: spec.resources.nodes"),
]


@pytest.mark.parametrize("old,new,child_suspended,suspend,size,refused",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_what_a_spec_change_does(cpu_job, old, new, child_suspended, suspend, size, refused):
    applied = parse_manifest(cpu_job)
    change = decide(changed(cpu_job["spec"], **old), changed(cpu_job["spec"], **new), applied, child_suspended)
    if refused:
        assert refused in change.refused
        assert change.suspend is None and change.resized is None
        return
    assert change.refused is None
    assert change.suspend is suspend
    if size is None:
        assert change.resized is None
    else:
        nodes, processes = size
        assert (change.resized.spec.resources.nodes, change.resized.spec.processes_per_node) == (nodes, processes)
        assert change.size_from == Size(2, 2, 0) and change.size_to == Size(nodes, processes, 0)


def test_a_resize_message_names_both_sizes(cpu_job):
    change = decide(changed(cpu_job["spec"], suspend=True), changed(cpu_job["spec"], suspend=True, resources__nodes=1),
                    parse_manifest(cpu_job), True)
    assert change.resize_message == ("resized from 2x2 processes to 1x2 processes; "
                                     "the run continues from its latest checkpoint")


@pytest.mark.parametrize("size,words", [(Size(2, 2, 0), "2x2 processes"), (Size(1, 1, 0), "1x1 process"),
                                        (Size(2, 8, 8), "2x8 GPUs"), (Size(1, 1, 1), "1x1 GPU")])
def test_sizes_read_as_nodes_times_processes(size, words):
    assert size.describe() == words


def test_a_size_refused_while_running_is_applied_when_the_job_is_next_suspended(cpu_job):
    """The size is compared with what runs (the trainer config), not only with the previous spec."""
    applied = parse_manifest(cpu_job)
    smaller = changed(cpu_job["spec"], resources__nodes=1)
    assert "suspend first" in decide(cpu_job["spec"], smaller, applied, False).refused
    # kopf now remembers nodes: 1 as the old spec; the user suspends.
    change = decide(smaller, changed(smaller, suspend=True), applied, False)
    assert change.suspend is True and change.resized.spec.resources.nodes == 1


def test_a_resize_changes_the_size_and_nothing_else_of_what_runs(cpu_job):
    """A change refused earlier (here the rank) stays out of the trainer config a resize rewrites."""
    applied = parse_manifest(cpu_job)
    spec_now = changed(cpu_job["spec"], suspend=True, adapter__rank=32, resources__nodes=1)
    change = decide(changed(cpu_job["spec"], suspend=True, adapter__rank=32), spec_now, applied, True)
    assert change.resized.spec.adapter.rank == applied.spec.adapter.rank == 8
    assert change.resized.spec.resources.nodes == 1 and change.resized.spec.suspend is True
    assert change.resized.model_dump(exclude={"spec": {"resources", "suspend"}}) == \
        applied.model_dump(exclude={"spec": {"resources", "suspend"}})


def test_a_gpu_job_resized_to_the_cpu_keeps_a_valid_spec(cpu_job):
    gpu = changed(cpu_job["spec"], resources__gpusPerNode=4, distributed__processesPerNode=None, suspend=True)
    cpu_job["spec"] = gpu
    resized = with_size(parse_manifest(cpu_job), parse_manifest({**cpu_job, "spec": changed(
        gpu, resources__gpusPerNode=0, distributed__processesPerNode=3)}).spec)
    assert Size.of(resized.spec) == Size(2, 3, 0)


def test_changed_paths_name_leaves_and_ignore_spelled_out_defaults(cpu_job):
    spec = cpu_job["spec"]
    assert changed_paths(spec, changed(spec, adapter__rank=16, suspend=True)) == ["adapter.rank", "suspend"]
    assert changed_paths(spec, changed(spec, runPolicy__backoffLimit=3)) == []  # 3 is the default
    assert changed_paths(spec, changed(spec, distributed=None)) == ["distributed.processesPerNode"]


def test_the_trainer_config_reads_back_as_the_job(cpu_job):
    job = parse_manifest(cpu_job)
    assert job_from_config_map(build_config_map(job)["data"]) == job


# ---- the PyTorchJob side --------------------------------------------------------------------------------

def test_a_resize_patch_replaces_replicas_and_processes_only_while_suspended(cpu_job):
    backend = PyTorchJobBackend()
    running = backend.build(parse_manifest(cpu_job), UID, SETTINGS)
    smaller = with_size(parse_manifest(cpu_job), parse_manifest(
        {**cpu_job, "spec": changed(cpu_job["spec"], resources__nodes=1)}).spec)
    patch = backend.resize_patch(running, smaller, UID, SETTINGS)
    assert patch[0] == {"op": "test", "path": "/spec/runPolicy/suspend", "value": True}
    ops = {op["path"]: op for op in patch[1:]}
    assert set(ops) == {"/spec/nprocPerNode", "/spec/pytorchReplicaSpecs"}
    assert ops["/spec/nprocPerNode"]["value"] == "2"
    replicas = ops["/spec/pytorchReplicaSpecs"]["value"]
    assert set(replicas) == {"Master"}  # replaced whole: the Worker goes
    assert replicas["Master"] == running["spec"]["pytorchReplicaSpecs"]["Master"]


def test_a_resize_drops_gpu_limits_and_keeps_the_running_image(cpu_job):
    backend = PyTorchJobBackend()
    gpu_job = parse_manifest({**cpu_job, "spec": changed(cpu_job["spec"], resources__gpusPerNode=2,
                                                         distributed__processesPerNode=None)})
    running = backend.build(gpu_job, UID, Settings(trainer_image="registry.example/kubetune/trainer:1.1"))
    to_cpu = with_size(gpu_job, parse_manifest(cpu_job).spec)
    replicas = backend.resize_patch(running, to_cpu, UID, SETTINGS)[2]["value"]
    for replica in replicas.values():
        container = replica["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        assert container["image"] == "registry.example/kubetune/trainer:1.1"


@pytest.mark.parametrize("child,suspended", [({"spec": {"runPolicy": {"suspend": True}}}, True),
                                             ({"spec": {"runPolicy": {"suspend": False}}}, False),
                                             ({"spec": {"runPolicy": {}}}, False), ({}, False)])
def test_a_child_is_suspended_when_its_run_policy_says_so(child, suspended):
    assert PyTorchJobBackend().is_suspended(child) is suspended
