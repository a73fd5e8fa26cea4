"""The Helm chart: lint-clean, schema-guarded values, and manifests/install.yaml equal to its rendering."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.conftest import REPO

CHART = REPO / "charts" / "kubetune"


@pytest.fixture(scope="module")
def helm() -> str:
    from kubetune_dev import versions

    try:
        return str(versions.binary("helm"))
    except versions.MissingBinary as err:
        pytest.fail(f"helm is built by devcluster/build.sh (make cluster-bins): {err}")


def render(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, "template", "kubetune", str(CHART), "--namespace", "kubetune-system",
                           "--kube-version", "v1.34.4", *args], capture_output=True, text=True)


def test_chart_lints_cleanly(helm):
    result = subprocess.run([helm, "lint", str(CHART), "--strict", "--kube-version", "v1.34.4"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_install_manifest_is_the_rendered_chart(helm):
    rendered = render(helm, "--include-crds", "--skip-tests")
    assert rendered.returncode == 0, rendered.stderr
    committed = (REPO / "manifests" / "install.yaml").read_text().split("\n", 1)[1]
    assert committed == rendered.stdout, "run `make manifests` and commit manifests/install.yaml"


def test_unknown_values_are_refused_by_the_schema(helm):
    result = render(helm, "--set", "operator.replicas=3")
    assert result.returncode != 0
    assert "replicas" in result.stderr and "additional properties" in result.stderr.lower()


def test_every_value_has_a_comment_above_it():
    lines = [line for line in (CHART / "values.yaml").read_text().splitlines() if line.strip()]
    for previous, line in zip(lines, lines[1:]):
        if not line.lstrip().startswith(("#", "- ")) and ":" in line:
            assert previous.lstrip().startswith("#"), f"no comment above {line.strip()!r} in values.yaml"


def test_operator_deployment_is_single_recreate_and_restricted(helm):
    documents = [d for d in yaml.safe_load_all(render(helm).stdout) if d]
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
