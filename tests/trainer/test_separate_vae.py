"""spec.model.vae: another VAE than the model's own (SDXL's fp16-fix VAE, say), checked against the
denoiser's latent channels before anything loads; in fp16 a VAE that overflows there runs in fp32."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from kubetune_api.manifest import parse_manifest
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families import family_for
from tests.trainer.conftest import family_job, run_trainer_expecting_failure

pytestmark = pytest.mark.slow


def vae_copy(model, out, **config):
    """The model's own VAE folder copied to `out`, its config changed by `config`."""
    shutil.copytree(model / "vae", out)
    settings = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**settings, **config}))
    return out


def sdxl(model, data, out, dtype=torch.float32, **model_fields):
    manifest = family_job("sdxl", "captions", model, data, out, model=model_fields)
    spec = parse_manifest(manifest).spec
    return family_for("sdxl")(spec, torch.device("cpu"), dtype)


def test_the_named_vae_encodes_and_names_the_cached_latents(tiny_model, tiny_dataset, tmp_path):
    model = tiny_model("sdxl")
    other = vae_copy(model, tmp_path / "fp16-fix-vae", scaling_factor=0.2, force_upcast=False)
    family = sdxl(model, tiny_dataset("captions"), tmp_path / "out", vae=str(other))
    assert family.sd.vae.config.scaling_factor == 0.2
    own = sdxl(model, tiny_dataset("captions"), tmp_path / "out")
    assert family.encoders()["latents"].identity != own.encoders()["latents"].identity, \
        "its latents are cached under its own identity (its files and config), never the model's own VAE's"


def test_a_vae_with_other_latent_channels_is_refused_naming_the_field(tiny_model, tiny_dataset, tmp_path):
    model = tiny_model("sdxl")
    other = vae_copy(model, tmp_path / "sd3-vae", latent_channels=16)
    with pytest.raises(ConfigError, match=r"^spec.model.vae: .*sd3-vae makes 16-channel latents but the sdxl model "
                                          r"in spec.model.pretrained was trained on 4 \(latent_channels of its own vae/\)"):
        sdxl(model, tiny_dataset("captions"), tmp_path / "out", vae=str(other))
    manifest = family_job("sdxl", "captions", model, tiny_dataset("captions"), tmp_path / "out", model={"vae": str(other)})
    assert "spec.model.vae:" in run_trainer_expecting_failure(manifest, tmp_path)
    assert not (tmp_path / "out").exists(), "refused before anything is written"


def test_in_fp16_a_vae_that_overflows_runs_in_fp32_and_a_fixed_one_in_fp16(tiny_model, tiny_dataset, tmp_path):
    model = tiny_model("sdxl")
    stock = sdxl(model, tiny_dataset("captions"), tmp_path / "out", dtype=torch.float16)
    assert stock.sd.vae.config.force_upcast and stock.sd.vae.dtype == torch.float32, "no NaN latents in fp16"
    fixed = vae_copy(model, tmp_path / "fp16-fix-vae", force_upcast=False)
    assert sdxl(model, tiny_dataset("captions"), tmp_path / "out", dtype=torch.float16,
                vae=str(fixed)).sd.vae.dtype == torch.float16
