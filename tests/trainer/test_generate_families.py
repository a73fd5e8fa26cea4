"""Every image family draws through kubetune_trainer.results.generation on its tiny model, in this one process:
the base model, then weights saved by the family's own writer and loaded back by its reader (each
trained parameter moved, as training would), from the job's own validation inputs (held-out captions,
edit pairs, PMG users). A real run end to end, the CLI and its refusals: test_generate.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kubetune_api.families import FAMILIES
from kubetune_api.spec import TrainingJob
from tests.trainer.conftest import family_job

pytestmark = pytest.mark.slow

IMAGE_FAMILIES = [name for name, row in FAMILIES.items() if {"clip_score", "clip_directional"} & set(row.metrics)]


def moved_weights(family) -> dict[str, torch.Tensor]:
    """Every trained parameter moved off its start (a LoRA's up projection starts at zero), as a run's
    weights would be after some steps."""
    generator = torch.Generator().manual_seed(1)
    return {name: (param.detach().float() + 0.5 * torch.randn(param.shape, generator=generator)).to(param.dtype)
            for name, param in family.trainable_module.named_parameters() if param.requires_grad}


def pixels(generated) -> np.ndarray:
    return np.stack([np.asarray(item.image.convert("RGB"), dtype=np.float32) for item in generated])


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_each_family_draws_the_base_then_its_saved_weights(family, tiny_model, tiny_dataset, tmp_path):
    from kubetune_trainer.results.generation import Generator, Request

    layout = FAMILIES[family].layouts[0]
    job = TrainingJob.model_validate(family_job(family, layout, tiny_model(family), tiny_dataset(layout),
                                                tmp_path / "out", validation={"numSamples": 1}))
    generator = Generator(job, "cpu")
    request = Request(steps=2)
    base = generator.generate(request)
    assert len(base) == 1 and all(item.step == "base" and item.prompt for item in base)
    assert all(item.image.size == (32, 32) for item in base), "at the job's training size"

    weights = moved_weights(generator.family)
    generator.family.save_weights(tmp_path / "weights", weights)
    generator.load_weights(tmp_path / "weights", "final")
    loaded = dict(generator.family.trainable_module.named_parameters())
    for name, value in weights.items():
        assert torch.equal(loaded[name].detach().to(value.dtype), value), f"{name} loaded as saved"
    tuned = generator.generate(request)
    assert [item.prompt for item in tuned] == [item.prompt for item in base], "the same inputs"
    assert all(item.step == "final" and item.family == family and item.job == "tiny" for item in tuned)
    assert np.abs(pixels(tuned) - pixels(base)).max() > 0, "the trained weights change what is drawn"
    if layout == "pmg":
        assert all(item.history for item in tuned), "each image drawn for a held-out user's history"


def test_an_edit_family_edits_the_control_images_given(tiny_model, tiny_dataset, tmp_path):
    """--control IMAGE --prompt TEXT: each given image edited by its instruction, not the held-out pairs."""
    from kubetune_trainer.results.generation import Generator, Request

    data = tiny_dataset("edit-pairs")
    job = TrainingJob.model_validate(family_job("flux-kontext", "edit-pairs", tiny_model("flux-kontext"), data,
                                                tmp_path / "out"))
    generator = Generator(job, "cpu")
    first, second = sorted((data / "control_images").iterdir())[:2]
    edits = [generator.generate(Request(prompts=("make it blue",), controls=(control,), steps=2, seed=5))
             for control in (first, second)]
    assert [item.prompt for items in edits for item in items] == ["make it blue", "make it blue"]
    assert np.abs(pixels(edits[0]) - pixels(edits[1])).max() > 0, "same seed and instruction: the control differs"
