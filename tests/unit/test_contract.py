"""The operator <-> trainer contract (kubetune_api.contract): one set of names, used by both sides."""
from __future__ import annotations

import re

import pytest

from kubetune_api import contract
from kubetune_api.contract import NodeEnv, TrainerEnv, TrainerGauge
from kubetune_api.manifest import parse_manifest
from kubetune_operator.backends import BACKENDS
from kubetune_operator.pod_template import trainer_env
from kubetune_operator.settings import Settings
from tests.conftest import REPO

TRAINER_SOURCES = REPO / "trainer_image" / "src" / "kubetune_trainer"


# ---- the environment the operator sets ------------------------------------------------------------

@pytest.mark.parametrize("trainer_env_object", [
    TrainerEnv(),
    TrainerEnv(job_name="sd15", namespace="team-a", run_id="0d7f-uid", metrics_port=9400, metrics_addr="127.1.0.5",
               cache_dir="/var/cache/kubetune/inputs", staging_dir="/var/cache/kubetune/staging", s3_path_style=True),
    TrainerEnv(run_id="uid", s3_path_style=False),
], ids=["nothing-set", "everything-set", "path-style-false"])
def test_what_the_operator_writes_the_trainer_reads_back_unchanged(trainer_env_object):
    rendered = {entry["name"]: entry["value"] for entry in trainer_env_object.to_env()}
    assert TrainerEnv.from_env(rendered) == trainer_env_object


@pytest.mark.parametrize("environ,expected", [
    ({}, TrainerEnv()),
    ({"KUBETUNE_RUN_ID": ""}, TrainerEnv()),  # empty is unset: a local run without an id
    ({"KUBETUNE_METRICS_PORT": "9555", "KUBETUNE_S3_PATH_STYLE": "1"}, TrainerEnv(metrics_port=9555, s3_path_style=True)),
    ({"KUBETUNE_S3_PATH_STYLE": "maybe"}, TrainerEnv()),
])
def test_the_trainer_reads_its_environment_through_the_contract(environ, expected):
    assert TrainerEnv.from_env(environ) == expected


def test_every_kubetune_variable_of_a_pod_is_a_contract_name_and_the_trainer_reads_each(example_manifest):
    job = parse_manifest({**example_manifest, "metadata": {"name": "x", "namespace": "team-a"}})
    set_by_operator = {e["name"] for e in trainer_env(job, "uid", Settings(s3_path_style=True, progress_url="http://operator:9401",
                                                                   progress_inbox_address="0.0.0.0"))
                       if e["name"].startswith("KUBETUNE_")}
    # The CPU request and limit come from the downward API (per container), not from a TrainerEnv value.
    downward = {contract.CPU_REQUEST_MILLICORES: "CPU_REQUEST_MILLICORES",
                contract.CPU_LIMIT_MILLICORES: "CPU_LIMIT_MILLICORES"}
    assert set_by_operator == set(TrainerEnv.NAMES.values()) | set(downward)
    # Read by name, through the contract's constant, or through TrainerEnv (TrainerEnv.from_env(os.environ).run_id).
    read_by_trainer = set()
    for source in TRAINER_SOURCES.rglob("*.py"):
        text = source.read_text()
        read_by_trainer |= set(re.findall(r"KUBETUNE_[A-Z0-9_]+", text))
        read_by_trainer |= {name for name, constant in downward.items() if re.search(rf"\b{constant}\b", text)}
        read_by_trainer |= {TrainerEnv.NAMES[field] for field in re.findall(r"TrainerEnv\.from_env\([^)]*\)\.(\w+)", text)}
        read_by_trainer |= {TrainerEnv.NAMES[field] for field in re.findall(r"TrainerEnv\.NAMES\[\"(\w+)\"\]", text)}
        for variable in re.findall(r"(\w+) = TrainerEnv\.from_env\(", text):  # env = TrainerEnv.from_env(...); env.x
            read_by_trainer |= {TrainerEnv.NAMES[field] for field in re.findall(rf"\b{variable}\.(\w+)", text)
                                if field in TrainerEnv.NAMES}
    needed = {name for field, name in TrainerEnv.NAMES.items() if field not in TrainerEnv.INFORMATIONAL} | set(downward)
    unread = needed - read_by_trainer
    assert not unread, f"the operator sets {sorted(unread)}, which no trainer module reads"


# ---- the environment the Kubeflow controllers set ------------------------------------------------

@pytest.mark.parametrize("environ,expected", [
    # Training Operator v1 (PyTorchJob): MASTER_ADDR/MASTER_PORT plus PET_*.
    ({"MASTER_ADDR": "sd15-master-0", "MASTER_PORT": "23456", "PET_NNODES": "2", "PET_NODE_RANK": "1",
      "PET_NPROC_PER_NODE": "4"}, NodeEnv(4, 2, 1, "sd15-master-0", 23456)),
    # Trainer v2 (TrainJob, torch plugin): PET_MASTER_ADDR/PET_MASTER_PORT only.
    ({"PET_MASTER_ADDR": "sd15-node-0-0.sd15", "PET_MASTER_PORT": "29500", "PET_NNODES": "3", "PET_NODE_RANK": "2",
      "PET_NPROC_PER_NODE": "8"}, NodeEnv(8, 3, 2, "sd15-node-0-0.sd15", 29500)),
    # Both present: the PET_ names win.
    ({"PET_MASTER_ADDR": "a", "MASTER_ADDR": "b", "PET_MASTER_PORT": "1", "MASTER_PORT": "2"},
     NodeEnv(master_addr="a", master_port=1)),
    ({"PET_NNODES": "1:2", "PET_NPROC_PER_NODE": "auto"}, NodeEnv(processes=1, nodes=2)),  # elastic range, "auto"
    ({"RANK": "3"}, NodeEnv(node_rank=3)),
    ({}, NodeEnv()),
], ids=["pytorchjob", "trainjob", "both", "elastic-and-auto", "rank-fallback", "local"])
def test_a_pod_finds_its_place_from_either_controllers_environment(environ, expected):
    from kubetune_trainer.pod import node_place
    from kubetune_trainer.process.launcher import NodePlace

    assert NodeEnv.from_env(environ) == expected
    assert node_place(environ) == NodePlace(expected.processes, expected.nodes, expected.node_rank,
                                            expected.master_addr, expected.master_port)


def test_no_backend_sets_a_variable_its_controller_reserves(example_manifest):
    job = parse_manifest({**example_manifest, "metadata": {"name": "x", "namespace": "team-a"}})
    names = {e["name"] for e in trainer_env(job, "uid", Settings())}
    assert not names & set(NodeEnv.RESERVED)
    trainjob = BACKENDS["trainjob"].build(job, "uid", Settings())
    assert not {e["name"] for e in trainjob["spec"]["trainer"]["env"]} & set(NodeEnv.RESERVED)


# ---- the metrics the operator reads back ---------------------------------------------------------

def test_the_trainer_serves_every_gauge_the_operator_reads():
    from kubetune_trainer.telemetry.metrics import TrainerMetrics

    metrics = TrainerMetrics("team-a", "sd15", port=None)
    served = {metric.name for metric in metrics.registry.collect()}
    read = set(TrainerGauge.ALL) | {TrainerGauge.validation(name) for name in contract.VALIDATION_METRICS}
    missing = {TrainerGauge.full_name(name) for name in read} - served
    assert not missing, f"the operator reads {sorted(missing)}, which the trainer does not serve"


def test_every_metric_a_family_validates_or_a_sweep_may_name_has_a_gauge():
    from kubetune_api.families import FAMILIES
    from kubetune_api.sweep import VALIDATION_METRICS as OBJECTIVES

    reported = {metric for family in FAMILIES.values() for metric in family.metrics}
    assert reported | set(OBJECTIVES.values()) <= set(contract.VALIDATION_METRICS)


def test_a_validation_the_trainer_serves_reaches_the_status_the_operator_writes():
    """Over HTTP, as the operator polls: gauge names in, status.validation out."""
    from kubetune_operator.kube import read_trainer_gauges
    from kubetune_operator.status import status_from_metrics
    from kubetune_trainer.telemetry.metrics import TrainerMetrics

    metrics = TrainerMetrics("team-a", "sd15", port=0, addr="127.0.0.1")
    try:
        metrics.validation(40, {"loss": 0.0123456789, "accuracy": 0.5})
        samples = read_trainer_gauges("127.0.0.1", metrics.server.port)
    finally:
        metrics.server.close()
    assert status_from_metrics(samples, "s3://b/runs", "team-a", "sd15")["validation"] == {
        "step": 40, "metrics": {"loss": 0.0123457, "accuracy": 0.5}}


# ---- the API, the entry point and the config mount ----------------------------------------------------

def test_the_crd_is_named_by_the_contract():
    from kubetune_api.crd import build_crd

    crd = build_crd()
    assert crd["metadata"]["name"] == f"{contract.PLURAL}.{contract.API_GROUP}"
    assert crd["spec"]["group"] == contract.API_GROUP and crd["spec"]["names"]["kind"] == contract.KIND
    assert crd["spec"]["names"]["shortNames"] == list(contract.SHORT_NAMES)


def test_both_backends_run_the_contracts_entry_point_on_the_mounted_config(example_manifest):
    from kubetune_operator.backends.trainjob import RuntimeValues, runtime

    job = parse_manifest({**example_manifest, "metadata": {"name": "x", "namespace": "team-a"}})
    pytorchjob = BACKENDS["pytorchjob"].build(job, "uid", Settings())
    trainjob_pod = runtime(RuntimeValues())["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]
    for pod in (pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"], trainjob_pod):
        container = pod["containers"][0]
        assert (container["command"], container["args"]) == (list(contract.TRAINER_COMMAND), list(contract.TRAINER_ARGS))
        assert {"name": "config", "mountPath": contract.CONFIG_MOUNT, "readOnly": True} in container["volumeMounts"]


# ---- the contract's values written out nowhere else -------------------------------------------------

PACKAGES = [REPO / "api" / "src", REPO / "cli" / "src", REPO / "operator" / "src", REPO / "trainer_image" / "src",
            REPO / "devcluster" / "src"]
# Files that may still spell contract values out, each with why; every entry must still need it.
# None today: operator/src/kubetune_operator/handlers.py (being rewritten into one reconcile on another
# branch, so left unedited here) already names everything through the contract.
TOLERATED: set[str] = set()


def contract_values() -> dict[str, str]:
    """Every contract value worth grepping for -> its name in the contract."""
    values = {name: f"TrainerEnv.NAMES[{field!r}]" for field, name in TrainerEnv.NAMES.items()}
    values |= {getattr(contract, name): f"contract.{name}" for name in (
        "CPU_REQUEST_MILLICORES", "CPU_LIMIT_MILLICORES", "SWEEP_LABEL", "TRIAL_LABEL",
        "TRIAL_PARAMETERS_ANNOTATION", "TRIAL_EXPLOITED_FROM_ANNOTATION", "TRIAL_REPORTED_ANNOTATION",
        "CONFIG_PATH", "OPERATOR_READ_QUERY")}
    gauges = list(TrainerGauge.ALL) + [TrainerGauge.validation(metric) for metric in contract.VALIDATION_METRICS]
    values |= {TrainerGauge.full_name(gauge): "TrainerGauge" for gauge in gauges}
    values |= {getattr(contract.TrainerLog, name): f"TrainerLog.{name}" for name in ("STEP", "VALIDATION", "FINAL_WEIGHTS")}
    values[contract.API_GROUP_VERSION] = "contract.API_GROUP_VERSION"
    return values


def stray_literals() -> dict[str, list[str]]:
    """File (relative to the repository) -> 'line: value (use NAME)' for each quoted contract value."""
    patterns = {value: re.compile(r"""(?<![\w.])["']""" + re.escape(value) + r"""["']""")
                for value in contract_values()}
    strays: dict[str, list[str]] = {}
    for package in PACKAGES:
        for source in sorted(package.rglob("*.py")):
            if source.name == "contract.py" and source.parent.name == "kubetune_api":
                continue
            for number, line in enumerate(source.read_text().splitlines(), 1):
                for value, pattern in patterns.items():
                    if pattern.search(line):
                        strays.setdefault(str(source.relative_to(REPO)), []).append(
                            f"{number}: {value!r} (use {contract_values()[value]})")
    return strays


def test_no_package_spells_out_a_value_of_the_contract():
    strays = stray_literals()
    untolerated = {path: found for path, found in strays.items() if path not in TOLERATED}
    assert not untolerated, f"contract values written out (import them from kubetune_api.contract): {untolerated}"
    stale = {path for path in TOLERATED if path not in strays}
    assert not stale, f"{sorted(stale)} no longer spell out contract values: remove them from TOLERATED"


def test_the_grep_finds_a_contract_value_spelled_out(tmp_path, monkeypatch):
    """The grep above would see a stray (so its silence means something)."""
    stray = tmp_path / "api" / "src" / "stray.py"
    stray.parent.mkdir(parents=True)
    stray.write_text('import os\nport = os.environ.get("KUBETUNE_METRICS_PORT")\nLABEL = "kubetune.dev/sweep"\n')
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGES", [tmp_path / "api" / "src"])
    assert [line.split(":")[0] for line in stray_literals()["api/src/stray.py"]] == ["2", "3"]


# ---- the log lines a local sweep reads ----------------------------------------------------------------

def test_each_log_line_the_trainer_writes_is_read_back_by_its_pattern():
    log = contract.TrainerLog
    text = "\n".join([
        "INFO " + log.STEP % (7, 20, 0.123456, 1e-4, 3.5),
        "INFO " + log.STEP % (8, 20, float("nan"), 1e-4, 3.5),
        "INFO " + log.VALIDATION % (8, log.validation_metrics({"loss": 0.25, "clip_score": 31.5})),
        "INFO " + log.FINAL_WEIGHTS % ", ".join(["s3://b/run/v1/final/a.safetensors", "s3://b/run/v1/final/b.pt"]),
    ])
    steps = log.parse_steps(text)
    assert steps[0] == (7, 0.12346) and steps[1][0] == 8 and steps[1][1] != steps[1][1]  # NaN survives
    assert [log.parse_validation(line) for line in text.splitlines()][2] == (8, {"loss": 0.25, "clip_score": 31.5})
    assert log.parse_validation(text.splitlines()[0]) is None
    assert log.parse_final_weights(text) == ["s3://b/run/v1/final/a.safetensors"]
