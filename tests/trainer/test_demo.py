"""`make demo`, the README's first command, keeps working."""
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_the_demo_trains_the_example_and_ends_with_something_to_look_at(tmp_path):
    """The LoRA, the base-vs-fine-tuned grid (two labelled rows: the validation prompts drawn by the
    base and by the LoRA) and the run's report, each printed where it is."""
    from PIL import Image

    result = subprocess.run(["bash", "scripts/demo.sh", str(tmp_path / "demo")], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lora = tmp_path / "demo" / "checkpoints" / "default" / "sd15-lora-demo" / "v0" / "pytorch_lora_weights.safetensors"
    assert lora.is_file()
    assert f"LoRA:               {lora}" in result.stdout
    run = lora.parent
    grid = tmp_path / "demo" / "compare" / "grid.png"
    assert f"Base vs fine-tuned: {grid}" in result.stdout and f"Report:             {run / 'report.html'}" in result.stdout
    with Image.open(grid) as image, Image.open(grid.parent / "final-0.png") as drawn:
        assert image.size[1] == 2 * drawn.size[1], "two rows: the base's images above the LoRA's"
    assert 'id="training-curves"' in (run / "report.html").read_text()
    assert sorted(p.name for p in (tmp_path / "demo" / "compare").glob("*.png")) == [
        "base-0.png", "base-1.png", "final-0.png", "final-1.png", "grid.png"]
