"""The process kubelet's stand-in for kubetune's images does not depend on where the checkout is.

A pod that mounts a volume over the directory holding the checkout (an emptyDir at /tmp, with the
checkout cloned under /tmp) still runs kubetune: the sandbox shows the virtualenv and the sources
at a fixed place, /opt/kubetune-dev, mounted before the pod's volumes. These tests run the real
sandbox (it needs root, as the process kubelet does) with such a volume.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kubetune_dev import images


def run_sandbox(tmp_path: Path, argv: list[str], image_mounts: list[dict], volumes: list[dict],
                env: dict[str, str]) -> subprocess.CompletedProcess:
    spec = {"image": {"root": images.IMAGE_ROOT, "mounts": image_mounts}, "mounts": volumes,
            "workingDir": "/", "argv": argv, "env": env}
    spec_file = tmp_path / "container.json"
    spec_file.write_text(json.dumps(spec))
    return subprocess.run([sys.executable, "-m", "kubetune_dev.sandbox", str(spec_file)],
                          capture_output=True, text=True, timeout=60)


def test_the_image_stays_visible_when_a_volume_hides_the_directory_it_comes_from(tmp_path):
    checkout = tmp_path / "scratch" / "checkout"
    (checkout / "pkg").mkdir(parents=True)
    (checkout / "pkg" / "marker.txt").write_text("from the image")
    empty_dir = tmp_path / "empty-dir"
    empty_dir.mkdir()
    # The pod's emptyDir goes over scratch/, where the checkout lives (as /tmp over /tmp/kt-clone).
    result = run_sandbox(tmp_path, ["/bin/sh", "-c", f"cat {images.IMAGE_SRC}/pkg/marker.txt; echo; "
                                                     f"ls -A {tmp_path / 'scratch'}; echo end"],
                         [{"source": str(checkout), "target": images.IMAGE_SRC, "readOnly": True}],
                         [{"source": str(empty_dir), "target": str(tmp_path / "scratch"), "readOnly": False}],
                         {"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    # The image's file is there; the volume shows its own (empty) content, not the checkout.
    assert result.stdout.split("\n") == ["from the image", "end", ""]
    # The image is read-only inside the container, as the image layers of a real one are.
    result = run_sandbox(tmp_path, ["/bin/sh", "-c", f"touch {images.IMAGE_SRC}/pkg/new"],
                         [{"source": str(checkout), "target": images.IMAGE_SRC, "readOnly": True}], [],
                         {"PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "Read-only file system" in result.stderr
    assert not (checkout / "pkg" / "new").exists()


def test_kubetune_runs_from_the_fixed_image_paths_with_the_checkout_itself_hidden(tmp_path):
    trainer = images.resolve("kubetune/trainer:dev")
    empty_dir = tmp_path / "empty-dir"
    empty_dir.mkdir()
    code = ("import sys, yaml, kubetune_api, kubetune_trainer; "
            "print(sys.prefix); print(kubetune_api.__file__); print(kubetune_trainer.__file__)")
    # A volume over the checkout hides its sources (and a virtualenv inside it) at their host path.
    result = run_sandbox(tmp_path, ["python", "-c", code], images.image_mounts(),
                         [{"source": str(empty_dir), "target": images.HOST_SRC, "readOnly": False}],
                         {"PATH": ":".join(trainer.path), **trainer.env})
    assert result.returncode == 0, result.stderr
    prefix, api_file, trainer_file = result.stdout.split()
    assert prefix == images.IMAGE_VENV
    assert api_file == f"{images.IMAGE_SRC}/api/src/kubetune_api/__init__.py"
    assert trainer_file == f"{images.IMAGE_SRC}/trainer_image/src/kubetune_trainer/__init__.py"


def test_the_stand_in_images_name_no_path_of_the_checkout():
    """Whatever the checkout's path, an image's PATH and env only name fixed places."""
    for name, image in images.IMAGES.items():
        for value in [*image.path, *image.env.values()]:
            assert images.HOST_SRC not in value and images.HOST_VENV not in value, (name, value)
    assert images.source_roots() == tuple(f"{images.IMAGE_SRC}/{root}" for root in
                                          ("api/src", "cli/src", "operator/src", "trainer_image/src", "devcluster/src"))
