"""Shared test helpers: where the repository and its examples are, and how tests share workers."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


@pytest.fixture
def example_manifest() -> dict:
    """The SD1.5 example as a base for tests to vary, without its validation section: its prompts are
    refused by the families the tests switch it to (edit families, PMG), and a test that wants
    validation sets its own."""
    import yaml

    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    manifest["spec"].pop("validation", None)
    return manifest


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers: every test of the local control plane goes to one
    of them, in file order, since a machine runs one control plane at a time (tests/e2e/conftest.py);
    the other worker takes the unit, trainer and storage tests meanwhile, one at a time. (Marking the
    tests xdist_group does not group them with pytest 9: xdist renames item._nodeid, which pytest 9
    no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ControlPlaneTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "control-plane" if nodeid.startswith("tests/e2e/") else nodeid

    return ControlPlaneTestsTogether(config, log)
