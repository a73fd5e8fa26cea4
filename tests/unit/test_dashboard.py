"""The Grafana dashboard asks only for metrics that exist, filters on the chosen job, and covers
what its panels promise. (Whether each query returns data is for tests/e2e/test_metrics.py.)"""
from __future__ import annotations

import pytest

from tests import dashboards

# The names the NVIDIA DCGM exporter exposes: nothing of ours exports them.
EXTERNAL_PREFIXES = ("DCGM_",)
VARIABLES = {"namespace": "team-a", "trainingjob": "sd15-lora", "datasource": "prometheus"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return dashboards.load()


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every metric name the operator and the trainer export."""
    from prometheus_client import REGISTRY

    import kubetune_operator.metrics  # noqa: F401  (registers the operator's metrics)
    from kubetune_trainer.telemetry.metrics import TrainerMetrics

    trainer = TrainerMetrics("team-a", "sd15-lora", port=None)
    return dashboards.exported_names(REGISTRY) | dashboards.exported_names(trainer.registry)


def unknown_metrics(expr: str, exported: set[str]) -> set[str]:
    names = dashboards.metric_names(dashboards.substitute(expr, VARIABLES))
    return {name for name in names if name not in exported and not name.startswith(EXTERNAL_PREFIXES)}


# ---- the checker itself -------------------------------------------------------------------------

def test_the_checker_reports_a_metric_nobody_exports():
    exported = {"kubetune_trainer_loss"}
    assert unknown_metrics('max(kubetune_trainer_los{trainingjob="$trainingjob"})', exported) == {"kubetune_trainer_los"}
    assert unknown_metrics('rate({__name__="kubetune_made_up_total"}[$__rate_interval])', exported) == {
        "kubetune_made_up_total"}


def test_the_checker_does_not_mistake_labels_functions_or_keywords_for_metrics():
    expr = ('sum by (phase) (rate(kubetune_trainer_step_phase_seconds_total{phase="data_wait"}[$__rate_interval])) '
            '* on (pod) group_left (trainingjob) label_replace(DCGM_FI_DEV_GPU_UTIL, "pod", "$1", "trainer_pod", "(.*)")')
    assert dashboards.metric_names(dashboards.substitute(expr, VARIABLES)) == {
        "kubetune_trainer_step_phase_seconds_total", "DCGM_FI_DEV_GPU_UTIL"}


def test_a_histogram_and_a_counter_export_their_suffixed_names(exported):
    assert {"kubetune_trainer_step_duration_seconds_bucket", "kubetune_trainer_step_duration_seconds_count",
            "kubetune_operator_reconciles_total"} <= exported
    assert "kubetune_operator_reconciles" not in exported


def test_substitution_fills_variables_and_leaves_regex_back_references():
    assert dashboards.substitute('x{a="$namespace", b="${trainingjob}"}[$__rate_interval] "$1"', VARIABLES) == \
        'x{a="team-a", b="sd15-lora"}[1m] "$1"'
    with pytest.raises(KeyError, match=r"\$renamed"):
        dashboards.substitute('x{a="$renamed"}', VARIABLES)


def test_a_syntax_error_is_caught():
    with pytest.raises(ValueError):
        dashboards.metric_names("sum(rate(kubetune_trainer_step[1m])")


# ---- the dashboard ------------------------------------------------------------------------------

def test_every_query_parses_and_names_only_exported_metrics(dashboard, exported):
    queries = dashboards.queries(dashboard)
    assert len(queries) > 20
    problems = {}
    for query in queries:
        try:
            unknown = unknown_metrics(query.expr, exported)
        except ValueError as err:
            problems[query.where] = f"does not parse: {err}"
            continue
        if unknown:
            problems[query.where] = f"names metrics nobody exports: {sorted(unknown)}"
    assert not problems, problems


def test_every_trainer_selector_is_filtered_to_the_chosen_job(dashboard):
    """A panel that forgot the job's labels would mix every run in the cluster."""
    for query in dashboards.queries(dashboard):
        if query.where.startswith("variable"):
            continue
        expr = dashboards.substitute(query.expr, VARIABLES)
        selectors = [node for node in selectors_of(expr) if (node.name or "").startswith("kubetune_trainer_")]
        for node in selectors:
            matchers = {(m.name, m.value) for m in node.matchers.matchers}
            assert {("trainingjob_namespace", "team-a"), ("trainingjob", "sd15-lora")} <= matchers, \
                f"{query.where}: {node.name} is not filtered to $namespace/$trainingjob"


def selectors_of(expr: str) -> list:
    import promql_parser

    found = []
    promql_parser.walk(promql_parser.parse(expr), lambda node: found.append(node) if isinstance(
        node, promql_parser.VectorSelector) else None)
    return found


def test_the_panels_cover_the_run_and_the_operator(dashboard):
    used = set().union(*(dashboards.metric_names(dashboards.substitute(q.expr, VARIABLES))
                         for q in dashboards.queries(dashboard)))
    promised = {
        "kubetune_operator_trainingjobs", "kubetune_operator_admission_rejections_total",
        "kubetune_operator_reconciles_total", "kubetune_operator_progress_pushes_total", "kubetune_trainer_loss", "kubetune_trainer_learning_rate",
        "kubetune_trainer_samples_per_second", "kubetune_trainer_step_phase_seconds_total",
        "kubetune_trainer_checkpoint_save_duration_seconds_sum", "kubetune_trainer_checkpoint_upload_duration_seconds_sum",
        "kubetune_trainer_checkpoint_uploaded_bytes_total", "kubetune_trainer_checkpoint_size_bytes",
        "kubetune_trainer_gpu_memory_allocated_bytes", "kubetune_trainer_eta_seconds", "kubetune_trainer_step",
        "kubetune_trainer_planned_steps", "kubetune_trainer_pod_info", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED",
    }
    assert promised <= used, sorted(promised - used)


def test_dcgm_panels_join_the_gpus_to_the_jobs_pods(dashboard):
    for query in dashboards.queries(dashboard):
        if "DCGM_" in query.expr:
            names = dashboards.metric_names(dashboards.substitute(query.expr, VARIABLES))
            assert "kubetune_trainer_pod_info" in names, query.where
            assert "group_left" in query.expr and '"trainer_pod"' in query.expr, query.where


def test_variables_datasource_and_schema(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["definition"] == "label_values(kubetune_trainer_step, trainingjob_namespace)"
    assert variables["trainingjob"]["definition"] == \
        'label_values(kubetune_trainer_step{trainingjob_namespace="$namespace"}, trainingjob)'
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"]
    data_panels = [p for p in dashboards.panels(dashboard) if p["type"] != "row"]
    for panel in data_panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in dashboards.panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
