"""The reference architectures are the published models, and their config-only folders hold no weights."""
from __future__ import annotations

import pytest
import torch

from kubetune_trainer.families.components import build

from kubetune_trainer.models.reference_models import architecture, write_config_only

# Published parameter counts (model cards and papers).
PUBLISHED = [
    ("sd15", "unet", 859.5e6),                       # SD1.5 UNet
    ("sdxl", "unet", 2.567e9),                       # SDXL base UNet
    ("sdxl", "text_encoder_2", 694.7e6),             # OpenCLIP ViT-bigG/14 text tower
    ("flux-kontext", "transformer", 11.9e9),         # FLUX.1 [dev] / Kontext [dev] transformer
    ("flux-kontext", "text_encoder_2", 4.76e9),      # T5 v1.1 XXL encoder
    ("qwen-image-edit", "transformer", 20.4e9),      # Qwen-Image MMDiT
    ("qwen-image-edit", "text_encoder", 8.29e9),     # Qwen2.5-VL-7B-Instruct with its LM head
    ("pmg", "language_model", 6.74e9),               # LLaMA-2-7B
    ("classifier", "model", 86e6),                   # ViT-B/16 (86M, with its 1000-class head 86.6M)
]


def parameters(family: str, component: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build(architecture(family)[component]).parameters())


@pytest.mark.parametrize("family, component, published", PUBLISHED, ids=lambda v: str(v))
def test_reference_architecture_has_the_published_size(family, component, published):
    assert parameters(family, component) == pytest.approx(published, rel=0.02)


@pytest.mark.parametrize("family", ["sd15", "qwen-image-edit", "pmg", "classifier"])
def test_a_config_only_folder_has_every_config_and_no_weights(family, tmp_path):
    out = write_config_only(family, tmp_path / family)
    for component in architecture(family).values():
        assert (out / component.subfolder / "config.json").is_file()
    weights = [p for p in out.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    assert weights == []
    if family != "classifier":
        assert (out / "model_index.json").is_file() and (out / "scheduler" / "scheduler_config.json").is_file()


def test_config_only_needs_a_known_family(tmp_path):
    with pytest.raises(ValueError, match="no reference architecture for family 'sd3'; available: sd15, sdxl"):
        write_config_only("sd3", tmp_path)


def test_the_cli_asks_for_full_size_with_config_only(tmp_path):
    from click.testing import CliRunner

    from kubetune_cli.main import cli

    result = CliRunner().invoke(cli, ["dev", "tiny-model", "--family", "sdxl", "--out", str(tmp_path), "--config-only"])
    assert result.exit_code == 2 and "--config-only writes the real architecture's configs: add --full-size" in result.output
