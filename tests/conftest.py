"""Shared test helpers: where the repository and its examples are, and how tests share workers."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


@pytest.fixture
def example_manifest() -> dict:
    import yaml

    return yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())


def pytest_collection_modifyitems(items):
    """`make test` runs two pytest-xdist workers (--dist loadgroup): every test of the local control
    plane goes to one of them, in file order, since a machine runs one control plane at a time
    (tests/e2e/conftest.py); the other worker takes the unit, trainer and storage tests meanwhile."""
    e2e = REPO / "tests" / "e2e"
    for item in items:
        if e2e in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("control-plane"))
