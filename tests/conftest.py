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


# Tiny models and data sets, written once per session and shared by the trainer, storage and e2e tests
# (tests/trainer/conftest.py's tiny_sd15 and captions_data are two of them).
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family): a random-weight model of the family, written once per session."""
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            from kubetune_trainer.models.tiny_models import write_tiny_model

            made[family] = write_tiny_model(family, tmp_path_factory.mktemp(family), seed=0)
        return made[family]
    return make


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """tiny_dataset(layout): 8 generated 32-pixel samples in the layout, written once per session."""
    made: dict[str, Path] = {}

    def make(layout: str) -> Path:
        if layout not in made:
            from kubetune_trainer.data.tiny_data import write_tiny_data

            made[layout] = write_tiny_data(layout, tmp_path_factory.mktemp(layout), count=8, size=32, seed=0)
        return made[layout]
    return make


@pytest.fixture(scope="session")
def built_images() -> dict[str, str]:
    """Our two images of this checkout in the local podman store (`make images`' module builds them, or
    finds them current by their content label: 0.5 s), by name: {"operator": "localhost/kubetune/operator:dev",
    "trainer": ...}. Named on the registry the dev cluster runs as real containers (kubetune_dev.images)."""
    import subprocess
    import sys

    from kubetune_dev import image_build, images

    result = subprocess.run([sys.executable, "-m", "kubetune_dev.image_build"], capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return {name: f"{images.REAL_IMAGE_REGISTRY}/{image_build.image_name(name, 'kubetune', 'dev')}"
            for name in image_build.DOCKERFILES}


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
