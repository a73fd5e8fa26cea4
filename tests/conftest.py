"""Shared test helpers: where the repository and its examples are."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


@pytest.fixture
def example_manifest() -> dict:
    import yaml

    return yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
