"""Where a family's frozen encoders live (spec.model.encoderDevice): off the GPU through the
training steps when the embedding cache feeds them, on it to fill the cache and for validation
samples; the models the step runs itself stay on the GPU. One rule for the trainer, `kubetune plan`
and the operator's fit check (kubetune_api.spec.encoders_on_gpu)."""
from __future__ import annotations

import pytest
import torch

from kubetune_api.manifest import parse_manifest
from kubetune_api.spec import encoders_on_gpu
from kubetune_trainer.families.base import ModelFamily
from tests.family_options import set_fields

GPU = torch.device("cuda", 0)


class Recorded:
    """A frozen model that records where it was put (these machines have no GPU to put it on)."""

    def __init__(self):
        self.places: list[torch.device] = []

    def requires_grad_(self, flag):
        return self

    def to(self, device):
        self.places.append(torch.device(device))
        return self

    def eval(self):
        return self


class TwoEncodersAndAStepModel(ModelFamily):
    needed_in_step = ("language_model",)

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.models = {"text_encoder": Recorded(), "vae": Recorded(), "language_model": Recorded()}

    def frozen_models(self):
        return self.models

    def compute_loss(self, model, batch, random):
        raise NotImplementedError


def spec_of(example_manifest, **fields):
    return parse_manifest(set_fields(example_manifest, fields)).spec


@pytest.mark.parametrize("fields, on_gpu", [
    ({}, True),                                                          # auto, no cache: they are needed
    ({"spec.data.cache.enabled": True}, False),                          # auto with the cache: off
    ({"spec.data.cache.enabled": True, "spec.model.encoderDevice": "gpu"}, True),
    ({"spec.data.cache.enabled": True, "spec.model.encoderDevice": "cpu"}, False),
    # PMG's step runs its language model; it does not take encoderDevice, so auto keeps everything on.
    ({"spec.model.family": "pmg", "spec.data.layout": "pmg", "spec.data.cache.enabled": True, "spec.adapter": {}},
     True),
])
def test_the_rule(example_manifest, fields, on_gpu):
    assert encoders_on_gpu(spec_of(example_manifest, **fields)) is on_gpu


def test_with_the_cache_the_encoders_train_on_the_cpu_and_the_step_model_on_the_gpu(example_manifest):
    family = TwoEncodersAndAStepModel(spec_of(example_manifest, **{"spec.data.cache.enabled": True}), GPU,
                                      torch.bfloat16)
    models = family.models
    assert models["text_encoder"].places == [torch.device("cpu")] == models["vae"].places, "placed once, off"
    assert models["language_model"].places == [GPU], "the step runs it"


def test_validation_brings_the_encoders_to_the_gpu_and_sends_them_back(example_manifest, monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    family = TwoEncodersAndAStepModel(spec_of(example_manifest, **{"spec.data.cache.enabled": True}), GPU,
                                      torch.bfloat16)
    with family.frozen_on_device():
        assert family.models["vae"].places[-1] == GPU
    assert family.models["vae"].places == [torch.device("cpu"), GPU, torch.device("cpu")]
    assert family.models["language_model"].places == [GPU, GPU, GPU]


def test_without_the_cache_nothing_moves_for_validation(example_manifest):
    family = TwoEncodersAndAStepModel(spec_of(example_manifest), GPU, torch.bfloat16)
    with family.frozen_on_device():
        pass
    assert family.models["vae"].places == [GPU]
