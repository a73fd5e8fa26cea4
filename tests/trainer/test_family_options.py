"""Each option a family honours (kubetune_api.families) changes what it trains; the unit tests
(tests/unit/test_families_table.py, test_rules.py) show the others are refused.

"Changes what it trains" is measured in process on each family's tiny model: the loss of one
fixed batch, then one plain gradient step, then the loss of the batch again and the trained weights'
size. All come from the same seeds with and without the option, so any difference is its doing.
Options that do not touch the loss are shown by what they do: the embedding cache stores
entries, validation prompts produce sample images, a CLIP model scores the validation images
(tests/trainer/test_evaluation.py goes further), quantization asks for quantized weights
(real quantized loading needs CUDA: benchmarks/gpu_quantization_check.py shows it on a GPU).
"""
from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

from kubetune_api import families as table
from kubetune_api.spec import TrainingJob
from kubetune_trainer.results.drawing import Draw
from kubetune_trainer.results.evaluation import ClipScorer
from kubetune_trainer.families import family_for
from kubetune_trainer.training.randomness import SampleRandom
from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.family_options import SETTINGS, combinations, set_fields
from tests.trainer.conftest import family_job

pytestmark = pytest.mark.slow

BATCH_KEYS = [(0, 0), (0, 1)]
STEP_SIZE = 1.0  # big enough that one plain gradient step moves the loss measurably
# Each family's attention projection that a targetModules setting can name (the tiny models' own).
ONE_TARGET = {"classifier": ["q_proj"]}


@pytest.fixture(scope="module")
def wide_data(tmp_path_factory):
    """wide_data(layout): tiny data whose images are twice as wide as tall (so bucketing acts)."""
    made = {}

    def make(layout: str):
        if layout not in made:
            data = write_tiny_data(layout, tmp_path_factory.mktemp(layout), count=4, size=32, seed=0)
            for image in [*data.rglob("*.png"), *data.rglob("*.jpg")]:
                Image.open(image).resize((64, 32)).save(image)
            made[layout] = data
        return made[layout]
    return make


def build(manifest: dict):
    spec = TrainingJob.model_validate(manifest).spec
    torch.manual_seed(0)  # LoRA initialisation and adapter dropout draw from the global generator
    family = family_for(spec.model.family)(spec, torch.device("cpu"), torch.float32)
    dataset, _ = family.build_datasets()
    return family, family.collate([dataset[key] for key in BATCH_KEYS])


def signature(manifest: dict) -> tuple[float, float, float]:
    """(loss, loss after one gradient step, size of the trained weights after it) on the first batch
    (the weights' size tells apart steps that both drive a tiny classifier's loss to 0)."""
    family, batch = build(manifest)
    model, seed = family.trainable_module, family.spec.training.seed
    loss = family.compute_loss(model, batch, SampleRandom.for_keys(seed, BATCH_KEYS, 0))
    loss.backward()
    with torch.no_grad():
        for parameter in family.trainable_parameters():
            if parameter.grad is not None:
                parameter -= STEP_SIZE * parameter.grad
    again = family.compute_loss(model, batch, SampleRandom.for_keys(seed, BATCH_KEYS, 0))
    size = sum(parameter.detach().double().square().sum() for parameter in family.trainable_parameters())
    return loss.item(), again.item(), float(size)


def lora_to_start_from(manifest: dict, folder) -> str:
    """Non-zero LoRA weights of the job's shape, saved as the family saves them."""
    family, _ = build(manifest)
    generator = torch.Generator().manual_seed(1)
    trained = {name: torch.randn(p.shape, generator=generator) * 0.5
               for name, p in family.trainable_module.named_parameters() if p.requires_grad}
    family.save_weights(folder, trained)
    return str(folder)


@pytest.fixture
def base_job(tiny_model, wide_data, tmp_path):
    def make(family: str) -> dict:
        layout = table.FAMILIES[family].layouts[0]
        return family_job(family, layout, tiny_model(family), wide_data(layout), tmp_path / "out")
    return make


def with_option(manifest: dict, family: str, option: str, tmp_path) -> dict:
    changes = dict(SETTINGS[option])
    if option == table.INIT_FROM:
        changes["spec.adapter.initFrom"] = lora_to_start_from(manifest, tmp_path / "start")
    if option == table.LORA_TARGETS:
        changes["spec.adapter.targetModules"] = ONE_TARGET.get(family, ["to_q"])
    if option in (table.EMBEDDING_CACHE, table.ENCODER_DEVICE):
        changes["spec.data.cache.uri"] = str(tmp_path / "cache")
    return set_fields(copy.deepcopy(manifest), changes)


ACTING_ON_THE_LOSS = [(family, option) for family, option in combinations(honoured=True)
                      if option not in (table.QUANTIZATION, table.VAE, table.EMBEDDING_CACHE, table.ENCODER_DEVICE,
                                        table.VALIDATION_PROMPTS, table.GUIDANCE, table.CLIP_MODEL)]


@pytest.mark.parametrize("family", table.FAMILY_NAMES)
def test_each_honoured_option_changes_what_the_family_trains(family, base_job, tmp_path):
    manifest = base_job(family)
    baseline = signature(manifest)
    assert signature(manifest) == baseline, "the same job trains the same (else nothing below means anything)"
    unchanged = []
    for option in [o for f, o in ACTING_ON_THE_LOSS if f == family]:
        changed = signature(with_option(manifest, family, option, tmp_path))
        if torch.allclose(torch.tensor(changed), torch.tensor(baseline), rtol=1e-6, atol=0):
            unchanged.append(option)
    assert not unchanged, f"{family} trains the same with and without {unchanged} {baseline}"


@pytest.mark.parametrize("family", table.honouring(table.EMBEDDING_CACHE))
def test_the_embedding_cache_stores_what_the_family_encodes(family, base_job, tmp_path):
    from kubetune_trainer.run import open_cache

    family_model, batch = build(with_option(base_job(family), family, table.EMBEDDING_CACHE, tmp_path))
    family_model.cache = open_cache(family_model.spec)
    family_model.compute_loss(family_model.trainable_module, batch,
                              SampleRandom.for_keys(0, BATCH_KEYS, 0))
    assert family_model.cache.misses > 0 and any((tmp_path / "cache").rglob("*")), "entries were stored"


@pytest.mark.parametrize("family", table.honouring(table.VAE))
def test_a_named_vae_is_the_one_the_family_encodes_with(family, base_job, tmp_path):
    import shutil

    manifest = base_job(family)
    other = shutil.copytree(f"{manifest['spec']['model']['pretrained']}/vae", tmp_path / "other-vae")
    family_model, _ = build(set_fields(manifest, {"spec.model.vae": str(other)}))
    [vae] = [model for name, model in family_model.frozen_models().items() if name == "vae"]
    assert vae.config._name_or_path == str(other)


@pytest.mark.parametrize("family", table.honouring(table.ENCODER_DEVICE))
def test_encoder_device_moves_every_frozen_encoder_the_family_declares(family, base_job, tmp_path):
    # On a GPU run the declared models leave the GPU (tests/unit/test_encoder_placement.py shows the
    # moves); here: the family declares its encoders, so the option has something to move.
    family_model, _ = build(with_option(base_job(family), family, table.ENCODER_DEVICE, tmp_path))
    assert family_model.encoder_device == torch.device("cpu")
    frozen = family_model.frozen_models()
    assert frozen and all(name not in family_model.needed_in_step for name in frozen), frozen
    trained = {id(p) for p in family_model.trainable_module.parameters()}
    assert not any(id(p) in trained for model in frozen.values() for p in model.parameters())


@pytest.mark.parametrize("family", table.honouring(table.VALIDATION_PROMPTS))
def test_validation_prompts_become_sample_images(family, base_job, tmp_path):
    manifest = set_fields(with_option(base_job(family), family, table.VALIDATION_PROMPTS, tmp_path),
                          {"spec.validation.numInferenceSteps": 1})
    family_model, _ = build(manifest)
    images = family_model.sample_images(family_model.trainable_module, [], Draw.for_validation(family_model.spec))
    assert len(images) == len(SETTINGS[table.VALIDATION_PROMPTS]["spec.validation.prompts"])


@pytest.mark.parametrize("family", table.honouring(table.CLIP_MODEL))
def test_a_clip_model_scores_the_validation_images_with_the_familys_clip_metric(family, base_job, tiny_clip,
                                                                                 tmp_path):
    manifest = set_fields(with_option(base_job(family), family, table.CLIP_MODEL, tmp_path),
                          {"spec.validation.clipModel": str(tiny_clip), "spec.validation.numInferenceSteps": 2})
    family_model, batch = build(manifest)
    held_out = [batch]  # the first batch stands in for the held-out data
    draw = Draw.for_validation(family_model.spec)
    images = family_model.sample_images(family_model.trainable_module, held_out, draw)
    assert len(images) == 2, "numSamples held-out samples are drawn"
    metrics = family_model.image_metrics(images, held_out, draw, ClipScorer(str(tiny_clip), torch.device("cpu")))
    [clip_metric] = [m for m in table.FAMILIES[family].metrics if m.startswith("clip_")]
    assert set(metrics) == {clip_metric} and torch.isfinite(torch.tensor(metrics[clip_metric])), metrics


@pytest.mark.parametrize("family", table.honouring(table.GUIDANCE))
def test_the_guidance_scale_changes_the_sample_images(family, base_job, tiny_clip, tmp_path):
    import numpy as np

    def sample(**validation) -> list:
        manifest = set_fields(base_job(family), {"spec.validation.clipModel": str(tiny_clip),
                                                 "spec.validation.numInferenceSteps": 2,
                                                 "spec.validation.numSamples": 1,
                                                 **{f"spec.validation.{k}": v for k, v in validation.items()}})
        family_model, batch = build(manifest)
        return family_model.sample_images(family_model.trainable_module, [batch], Draw.for_validation(family_model.spec))

    default, guided = sample(), sample(guidanceScale=SETTINGS[table.GUIDANCE]["spec.validation.guidanceScale"])
    assert len(default) == len(guided) == 1
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(default, guided)), \
        f"{family}: guidance {SETTINGS[table.GUIDANCE]} draws what its default ({table.FAMILIES[family].guidance}) draws"


@pytest.mark.parametrize("family", table.honouring(table.QUANTIZATION))
def test_quantization_asks_for_quantized_base_weights(family, base_job, tmp_path, monkeypatch):
    from kubetune_trainer.training import quantization

    asked = []
    monkeypatch.setattr(quantization, "check_supported", lambda quant: None)  # CUDA-only: not on this CPU
    monkeypatch.setattr(quantization, "load_kwargs", lambda quant, dtype: asked.append(quant) or {})
    monkeypatch.setattr(quantization, "apply_after_load", lambda quant, module, dtype: None)
    manifest = set_fields(with_option(base_job(family), family, table.QUANTIZATION, tmp_path),
                          {"spec.resources.gpusPerNode": 1})
    build(manifest)
    # One ask per quantized denoiser the family loads (wan's two-expert tiny model trains both: two).
    assert asked and set(asked) == {SETTINGS[table.QUANTIZATION]["spec.model.quantization"]}, asked
