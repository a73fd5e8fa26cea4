"""`kubetune evaluate`'s model-given scores: lpips (--lpips-model, kubetune_trainer.results.lpips_distance) and hps
(--hps-model, a human-preference model in CLIP form). Random weights written in the published layouts:
a torchvision AlexNet features state_dict and LPIPS v0.1 linear weights (lin0.model.1.weight ...)."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from click.testing import CliRunner
from PIL import Image, ImageFilter

from kubetune_cli.main import cli
from tests.storage.conftest import s3_server  # noqa: F401 - a fixture, for the s3:// row
from tests.trainer.conftest import run_dir

pytestmark = pytest.mark.slow

ALEXNET_TAPPED_CHANNELS = [64, 192, 384, 256, 256]


def write_lpips_folder(folder, seed: int = 0):
    """backbone.pth: random tensors under torchvision AlexNet's features.* keys and shapes (its classifier
    left out: the loader reads features only); linear.pth: positive 1x1 weights as LPIPS v0.1 names them."""
    import torchvision

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):  # the layout without initialising AlexNet's 58M classifier weights
        layout = torchvision.models.alexnet().state_dict()
    backbone = {key: torch.randn(value.shape) * 0.05 for key, value in layout.items() if key.startswith("features.")}
    torch.save(backbone, folder / "backbone.pth")
    torch.save({f"lin{i}.model.1.weight": torch.rand(1, channels, 1, 1)
                for i, channels in enumerate(ALEXNET_TAPPED_CHANNELS)}, folder / "linear.pth")
    return folder


@pytest.fixture(scope="module")
def lpips_folder(tmp_path_factory):
    return write_lpips_folder(tmp_path_factory.mktemp("lpips") / "alex")


def test_lpips_is_zero_for_one_image_symmetric_and_grows_with_the_perturbation(lpips_folder):
    from kubetune_trainer.results.lpips_distance import LpipsDistance

    lpips = LpipsDistance(str(lpips_folder), torch.device("cpu"))
    torch.manual_seed(1)
    image, noise = torch.rand(1, 3, 64, 64), torch.randn(1, 3, 64, 64)
    distances = [lpips.distance(image, (image + amount * noise).clamp(0, 1)).item() for amount in (0, 0.05, 0.2, 0.5)]
    assert distances[0] == pytest.approx(0, abs=1e-7), "an image is at distance 0 from itself"
    assert 0 < distances[1] < distances[2] < distances[3], distances
    other = (image + 0.2 * noise).clamp(0, 1)
    assert lpips.distance(other, image).item() == pytest.approx(lpips.distance(image, other).item(), rel=1e-6)


def test_a_folder_that_is_not_lpips_weights_is_one_line_naming_the_option(lpips_folder, tiny_clip, tmp_path):
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.results.lpips_distance import LpipsDistance

    swapped = tmp_path / "swapped"
    swapped.mkdir()
    (swapped / "linear.pth").write_bytes((lpips_folder / "backbone.pth").read_bytes())
    (swapped / "backbone.pth").write_bytes((lpips_folder / "linear.pth").read_bytes())
    text = tmp_path / "text"
    text.mkdir()
    (text / "linear.pth").write_text("not torch")
    for folder, reason in ((tiny_clip, "no linear.pth there"),
                           (swapped, "linear.pth has not the keys lin0.model.1.weight"),
                           (text, "linear.pth is not a torch state_dict")):
        with pytest.raises(ConfigError) as refused:
            LpipsDistance(str(folder), torch.device("cpu"))
        message = str(refused.value)
        assert message.startswith(f"--lpips-model {folder}: {reason}"), message
        assert "expected a folder holding backbone.pth" in message and "\n" not in message


def test_lpips_weights_load_from_s3(lpips_folder, s3_server, tmp_path, monkeypatch):  # noqa: F811
    from kubetune_trainer.results.run_evaluation import lpips_scorer
    from kubetune_trainer.storage import s3
    from kubetune_trainer.storage.uri import parse_s3

    monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / "cache"))
    s3.client().create_bucket(Bucket="lpips-weights")
    files = sorted(lpips_folder.iterdir())
    s3.upload_files(files, lpips_folder, parse_s3("s3://lpips-weights/alex"))
    fetched = lpips_scorer("s3://lpips-weights/alex", torch.device("cpu"))
    local = lpips_scorer(str(lpips_folder), torch.device("cpu"))
    x, y = torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32)
    assert local.distance(x, y).item() > 0
    assert fetched.distance(x, y).item() == pytest.approx(local.distance(x, y).item(), rel=1e-6)


@pytest.fixture
def sd15_job(sd15_run):
    """The session's finished 2-step sd15 run (a quarter of its captions held out): its job folder."""
    return run_dir(sd15_run[1]).parent


def kubetune(*args: str):
    return CliRunner().invoke(cli, ["evaluate", *args], catch_exceptions=False)


def test_evaluate_adds_lpips_and_hps_columns_and_means(sd15_job, lpips_folder, tiny_clip, tmp_path, monkeypatch):
    """With a stand-in generation (the held-out images, the first blurred): lpips 0 for the untouched image
    and above 0 for the blurred one; hps 100 x the preference model's image-prompt cosine (here the same
    tiny CLIP as --clip-model, so 100 x clip_text)."""
    from kubetune_trainer.results import run_evaluation
    from kubetune_trainer.families.base import reference_path

    def stand_in(job, weights, samples, device):
        images = [Image.open(reference_path(sample)).convert("RGB") for sample in samples]
        return [images[0].filter(ImageFilter.GaussianBlur(2)), *images[1:]]

    monkeypatch.setattr(run_evaluation, "generate_for", stand_in)
    out = tmp_path / "scored"
    result = kubetune(str(sd15_job), "--out", str(out), "--clip-model", str(tiny_clip),
                      "--lpips-model", str(lpips_folder), "--hps-model", str(tiny_clip))
    assert result.exit_code == 0, result.output
    assert "lpips" in result.output and "hps" in result.output
    with open(out / "scores.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert float(rows[0]["lpips"]) > 0 and float(rows[1]["lpips"]) == pytest.approx(0, abs=1e-6)
    for row in rows:
        assert float(row["hps"]) == pytest.approx(100 * float(row["clip_text"]), abs=1e-3)
    metrics = json.loads((out / "metrics.json").read_text())
    for name in ("lpips", "hps"):
        assert metrics[name] == pytest.approx(sum(float(row[name]) for row in rows) / len(rows), abs=1e-5)
    assert metrics["lpips_model"] == str(lpips_folder) and metrics["hps_model"] == str(tiny_clip)


@pytest.mark.parametrize("option", ["--lpips-model", "--hps-model"])
def test_a_model_that_is_not_one_is_refused_before_anything_is_generated(sd15_job, tiny_sd15, option, tmp_path,
                                                                         monkeypatch):
    from kubetune_trainer.results import run_evaluation

    def never(*args):
        raise AssertionError("generated before the model was checked")

    monkeypatch.setattr(run_evaluation, "generate_for", never)
    result = kubetune(str(sd15_job), "--out", str(tmp_path / "x"), option, str(tiny_sd15))
    assert result.exit_code == 2
    assert result.output.startswith(f"kubetune evaluate: {option}") and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "x").exists()


def test_a_video_jobs_clips_refuse_the_image_scores_by_option():
    from pathlib import Path

    from kubetune_trainer.data.video_captions import CaptionedClip
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.results.run_evaluation import refuse_image_scores_for_clips

    clips = [CaptionedClip(Path("a.mp4"), "a cat")]
    refuse_image_scores_for_clips(clips, None, None)  # ssim and CLIP only: nothing to refuse
    for lpips, hps, option in (("/m/lpips", None, "--lpips-model"), (None, "/m/hps", "--hps-model")):
        with pytest.raises(ConfigError, match=f"^{option}: scores images, and this job's samples are video clips"):
            refuse_image_scores_for_clips(clips, lpips, hps)
