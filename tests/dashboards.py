"""The shipped Grafana dashboard, read the way Grafana reads it: its PromQL queries, with the
dashboard's variables filled in, and the metric names each query selects.

Shared by the unit test (every name is exported by someone) and the e2e test (every query
returns data from a real Prometheus scraping a real run).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import promql_parser

from tests.conftest import REPO

DASHBOARD = REPO / "charts" / "kubetune" / "dashboards" / "kubetune.json"
# Grafana's built-in interval variables, as Grafana would fill them for a short time range.
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


@dataclass(frozen=True)
class Query:
    where: str  # the panel title and refId, or the variable name: for failure messages
    expr: str  # as written in the dashboard


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict) -> list[Query]:
    """The panels' PromQL expressions and the selectors inside the variables' label_values()."""
    found = [Query(f"panel {panel['title']!r} {target['refId']}", target["expr"])
             for panel in panels(dashboard) for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(Query(f"variable {variable['name']!r}", label_values_selector(variable["definition"])))
    return found


def label_values_selector(definition: str) -> str:
    """label_values(SELECTOR, LABEL) -> SELECTOR (the only variable query form the dashboard uses)."""
    match = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", definition.strip())
    assert match, f"not a label_values(selector, label) query: {definition!r}"
    return match.group(1)


def substitute(expr: str, variables: dict[str, str], builtins: dict[str, str] = BUILTINS) -> str:
    """$name and ${name} replaced as Grafana does before the query reaches Prometheus.

    A variable the caller did not give is an error, so a renamed variable cannot slip through.
    """
    values = {**builtins, **variables}

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    # "$1" inside label_replace() is a regex back-reference, not a variable: names start with a letter or _.
    return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", value, expr)


def metric_names(expr: str) -> set[str]:
    """Names of the metrics the expression selects (a real PromQL parser, not a regex).

    Label names in {...}, by (...), on (...), group_left (...) and function names are not
    metrics, and the parser knows which is which; a selector by {__name__="x"} counts as x.
    """
    names: set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def exported_names(registry) -> set[str]:
    """The sample names a prometheus_client registry exposes, by each family's type.

    Families are listed even when a labelled metric has no child yet (no samples), so the
    names follow from the type: a counter x exposes x_total, a histogram x_bucket/_sum/_count.
    """
    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                "summary": ["", "_sum", "_count", "_created"], "info": ["_info"], "gauge": [""],
                "stateset": [""], "gaugehistogram": ["_bucket", "_gsum", "_gcount"], "unknown": [""]}
    names = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in suffixes[family.type])
        names.update(sample.name for sample in family.samples)
    return names
