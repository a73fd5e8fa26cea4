"""The benchmark stand-in that builds models from config-only folders (kubetune_trainer.models.random_weights):
what it builds matches what from_pretrained would have given, and it changes nothing else."""
import pytest
import torch

from kubetune_trainer.models.random_weights import built_from_configs
from kubetune_trainer.models.tiny_models import tiny_clip_text_encoder, tiny_vae


@pytest.fixture
def folders(tmp_path):
    """A tiny CLIP text encoder and VAE saved with weights, and the same configs saved without."""
    encoder, vae = tiny_clip_text_encoder(vocab_size=64), tiny_vae()
    encoder.save_pretrained(tmp_path / "weights" / "text_encoder")
    vae.save_pretrained(tmp_path / "weights" / "vae")
    encoder.config.save_pretrained(tmp_path / "configs" / "text_encoder")
    vae.save_config(tmp_path / "configs" / "vae")
    return tmp_path / "weights", tmp_path / "configs"


def shapes(model):
    return {name: (tuple(p.shape), p.dtype) for name, p in model.state_dict().items()}


def test_a_config_only_folder_builds_the_model_from_pretrained_would_load_in_the_dtype_asked(folders):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    weights, configs = folders
    loaded_encoder = CLIPTextModel.from_pretrained(weights / "text_encoder", torch_dtype=torch.bfloat16)
    loaded_vae = AutoencoderKL.from_pretrained(weights, subfolder="vae", torch_dtype=torch.bfloat16)
    state = torch.random.get_rng_state()
    with built_from_configs("cpu"):
        encoder = CLIPTextModel.from_pretrained(configs / "text_encoder", torch_dtype=torch.bfloat16)
        vae = AutoencoderKL.from_pretrained(configs, subfolder="vae", torch_dtype=torch.bfloat16)
        again = AutoencoderKL.from_pretrained(configs, subfolder="vae", torch_dtype=torch.bfloat16)
        still_loaded = AutoencoderKL.from_pretrained(weights, subfolder="vae", torch_dtype=torch.bfloat16)
    assert shapes(encoder) == shapes(loaded_encoder) and shapes(vae) == shapes(loaded_vae)
    assert not encoder.training and not vae.training, "in eval mode, as from_pretrained returns models"
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), again.state_dict().values())), "seeded"
    assert not torch.equal(vae.encoder.conv_in.weight, loaded_vae.encoder.conv_in.weight), "random, not the file's"
    assert torch.equal(still_loaded.encoder.conv_in.weight, loaded_vae.encoder.conv_in.weight), "weights load as usual"
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's random state is left as it was"


def test_the_auto_classes_config_overrides_apply_to_the_built_model(tmp_path):
    from transformers import AutoModelForImageClassification, ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=16, num_labels=7).save_pretrained(tmp_path)
    with built_from_configs("cpu"):
        model = AutoModelForImageClassification.from_pretrained(tmp_path, num_labels=3, ignore_mismatched_sizes=True)
    assert model.classifier.out_features == 3 and model.dtype == torch.float32


def test_quantizing_while_loading_is_refused_naming_what_to_use_instead(folders):
    from diffusers import AutoencoderKL

    from kubetune_trainer.errors import ConfigError

    with built_from_configs("cpu"), pytest.raises(ConfigError, match="cannot be quantized while loading.*fp8 or none"):
        AutoencoderKL.from_pretrained(folders[1], subfolder="vae", quantization_config=object())


def test_outside_the_context_a_config_only_folder_is_not_loadable(folders):
    from diffusers import AutoencoderKL

    with built_from_configs("cpu"):
        pass
    with pytest.raises(OSError):
        AutoencoderKL.from_pretrained(folders[1], subfolder="vae")
