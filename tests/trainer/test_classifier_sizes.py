"""The classifier trains at its model's own size unless told otherwise; another size works where the
model interpolates its position embeddings and is refused, naming the field, where it cannot."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_expecting_failure

pytestmark = pytest.mark.slow


def classifier_job(model, data, out, **data_fields):
    manifest = family_job("classifier", "image-folder", model, data, out, data={"resolution": None, **data_fields})
    return manifest


def test_unset_resolution_is_the_image_processors_and_another_size_interpolates(tiny_model, tiny_dataset, tmp_path):
    model, data = tiny_model("classifier"), tiny_dataset("image-folder")
    run_trainer(classifier_job(model, data, tmp_path / "native"), tmp_path)
    run_trainer(classifier_job(model, data, tmp_path / "larger", resolution=64), tmp_path)
    for name in ("native", "larger"):
        assert (run_dir(tmp_path / name) / "adapter_model.safetensors").is_file(), name


def test_a_size_the_model_cannot_take_is_refused_naming_the_field(tiny_dataset, tmp_path):
    from transformers import LevitConfig, LevitForImageClassification

    torch.manual_seed(0)  # LeViT's attention biases are sized for its image size: no interpolation
    LevitForImageClassification(LevitConfig(
        image_size=32, patch_size=16, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1],
        key_dim=[8, 8, 8], down_ops=[["Subsample", 8, 1, 4, 2, 2], ["Subsample", 8, 2, 4, 2, 2]], num_labels=2,
        kernel_size=3, stride=2, padding=1)).save_pretrained(tmp_path / "levit")
    manifest = classifier_job(tmp_path / "levit", tiny_dataset("image-folder"), tmp_path / "out", resolution=64)
    manifest["spec"]["adapter"] = {"type": "full"}
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    assert "spec.data.resolution: " in stderr and "takes 32x32 images and cannot run at 64x64" in stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"
