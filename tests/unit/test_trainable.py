"""families.trainable: what each kind of model trains, whether its checkpoints carry ready-to-pull
weights, and that what it writes loads back through the libraries' own loaders."""
from __future__ import annotations

import pytest
import torch

from kubetune_api.spec_model import AdapterSpec
from kubetune_trainer.families.trainable import diffusers_denoiser, transformers_classifier

LORA = AdapterSpec(type="lora", rank=2, alpha=2)
FULL = AdapterSpec(type="full")


def trained_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter, changed, as the loop would hand them over."""
    return {name: p.detach() + 1.0 for name, p in module.named_parameters() if p.requires_grad}


def tiny_classifier():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32, num_labels=3))


def test_a_lora_on_a_denoiser_trains_only_the_adapter_and_saves_the_pipelines_lora_file(tmp_path):
    from diffusers import StableDiffusionPipeline

    from kubetune_trainer.models.tiny_models import tiny_sd_unet

    unet = tiny_sd_unet()
    trainable = diffusers_denoiser(unet, LORA, "unet", "StableDiffusionPipeline")
    trained = trained_weights(trainable.module)
    assert trainable.publishable and trained and all("lora_" in name for name in trained)
    assert all(p.dtype == torch.float32 for p in trained.values())
    written = trainable.save(tmp_path / "out", trained)
    assert [p.name for p in written] == ["pytorch_lora_weights.safetensors"]
    state, _ = StableDiffusionPipeline.lora_state_dict(str(tmp_path / "out"))
    assert state and all(key.startswith("unet.") for key in state)
    assert len(state) == len(trained)


def test_a_whole_denoiser_trains_every_weight_and_saves_a_model_folder_only_at_the_end(tmp_path):
    from diffusers import UNet2DConditionModel

    from kubetune_trainer.models.tiny_models import tiny_sd_unet

    trainable = diffusers_denoiser(tiny_sd_unet(), FULL, "unet", "StableDiffusionPipeline")
    assert not trainable.publishable  # a whole model is too big to write at every checkpoint
    assert all(p.requires_grad for p in trainable.module.parameters())
    trained = trained_weights(trainable.module)
    trainable.save(tmp_path / "out", trained)
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "out" / "unet")
    name = next(iter(trained))
    assert torch.equal(loaded.state_dict()[name], trained[name])


def test_the_planner_attaches_a_lora_without_a_pipeline_but_such_a_lora_cannot_be_saved(tmp_path):
    from kubetune_trainer.models.tiny_models import tiny_sd_unet

    trainable = diffusers_denoiser(tiny_sd_unet(), LORA, "unet", pipeline=None, load_init=False)
    with pytest.raises(ValueError, match="without its pipeline"):
        trainable.save(tmp_path, trained_weights(trainable.module))


def test_a_classifier_lora_trains_its_new_head_whole_and_saves_a_peft_adapter(tmp_path):
    from peft import PeftModel

    trainable = transformers_classifier(tiny_classifier(), LORA)
    trained = trained_weights(trainable.module)
    assert trainable.publishable
    assert any("lora_" in name for name in trained) and any("classifier" in name and "lora_" not in name
                                                           for name in trained)
    trainable.save(tmp_path / "out", trained)
    reloaded = PeftModel.from_pretrained(tiny_classifier(), tmp_path / "out")
    head = next(name for name in trained if "classifier" in name and name.endswith("weight") and "lora_" not in name)
    assert torch.equal(reloaded.state_dict()[head], trained[head])


def test_a_whole_classifier_saves_a_transformers_model_folder(tmp_path):
    from transformers import ViTForImageClassification

    trainable = transformers_classifier(tiny_classifier(), FULL)
    assert not trainable.publishable
    trained = trained_weights(trainable.module)
    trainable.save(tmp_path / "out", trained)
    loaded = ViTForImageClassification.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.classifier.weight, trained["classifier.weight"])


@pytest.mark.parametrize("kind, adapter", [("denoiser", LORA), ("denoiser", FULL), ("classifier", LORA),
                                           ("classifier", FULL)])
def test_what_a_trainable_saved_its_reader_loads_into_a_fresh_model(kind, adapter, tmp_path):
    """Trainable.load, the counterpart of save: what generation and evaluation load a run's weights with."""
    from kubetune_trainer.models.tiny_models import tiny_sd_unet

    def make():
        if kind == "classifier":
            return transformers_classifier(tiny_classifier(), adapter)
        torch.manual_seed(0)
        return diffusers_denoiser(tiny_sd_unet(), adapter, "unet", "StableDiffusionPipeline")

    trained = trained_weights(make().module)
    make().save(tmp_path / "out", trained)
    fresh = make()
    fresh.load(tmp_path / "out")
    loaded = dict(fresh.module.named_parameters())
    assert all(torch.equal(loaded[name].detach(), value) for name, value in trained.items())
