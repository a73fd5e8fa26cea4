"""`kubetune export --format kohya` for the FLUX families: BFL's module names under `lora_unet_`, q, k
and v (and FLUX.1's single-block MLP input) fused into one LoRA pair, read back by diffusers' own
kohya converters (FLUX.1: _convert_kohya_flux_lora_to_diffusers, FLUX.2: _convert_kohya_flux2_…) as
the LoRA the trainer saved.

The weights are the family's own writer's (families.trainable), every trained parameter moved, in this
process: no run is trained. Alpha is twice the rank, so a wrong alpha/rank scale shows.
"""
from __future__ import annotations

import json
from pathlib import Path

import diffusers
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kubetune_api.families import FAMILIES
from kubetune_api.spec import TrainingJob
from kubetune_trainer.results.export import write_kohya
from kubetune_trainer.families import definition_for, family_for
from kubetune_trainer.families.lora import LORA_FILE
from kubetune_trainer.results.lora_keys import FLUX_KOHYA
from tests.trainer.conftest import family_job

pytestmark = pytest.mark.slow

# diffusers 0.42.1 splits FLUX.1's single-block linear1 at FLUX.1's own widths (3072 x 3 + 12288), so
# the tiny FLUX.1 Kontext model (width 32) is adapted without its single blocks' q, k, v here; they
# are checked at FLUX.1's sizes in test_flux1_single_block_linear1_splits_back_at_flux1s_sizes.
TARGETS = {"flux-kontext": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                            "transformer_blocks.0.attn.to_v", "transformer_blocks.0.attn.to_out.0",
                            "transformer_blocks.0.attn.add_k_proj", "single_transformer_blocks.0.proj_out"],
           "flux2": None, "flux2-klein": None}  # None: the family's default targets


def lora_deltas(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What each LoRA layer adds to its weight (B·A·scaling), by module."""
    deltas = {}
    for name, module in transformer.named_modules():
        if getattr(module, "lora_A", None):
            (adapter,) = module.lora_A.keys()
            deltas[name] = module.lora_B[adapter].weight @ module.lora_A[adapter].weight * module.scaling[adapter]
    return deltas


def saved_lora(family: str, tiny_model, tiny_dataset, folder: Path) -> Path:
    """The family's LoRA as its writer saves it, each trained parameter moved off its start."""
    layout = FAMILIES[family].layouts[0]
    adapter = {"rank": 4, "alpha": 8, **({"targetModules": TARGETS[family]} if TARGETS[family] else {})}
    job = TrainingJob.model_validate(family_job(family, layout, tiny_model(family), tiny_dataset(layout),
                                                folder / "out", adapter=adapter))
    model = family_for(family)(job.spec, torch.device("cpu"), torch.float32)
    noise = torch.Generator().manual_seed(1)
    moved = {name: param.detach() + 0.1 * torch.randn(param.shape, generator=noise)
             for name, param in model.trainable_module.named_parameters() if param.requires_grad}
    model.save_weights(folder / "weights", moved)
    return folder / "weights"


@pytest.mark.parametrize("family", ["flux-kontext", "flux2", "flux2-klein"])
def test_the_flux_kohya_file_loads_through_diffusers_as_the_same_lora(family, tiny_model, tiny_dataset, tmp_path):
    weights = saved_lora(family, tiny_model, tiny_dataset, tmp_path)
    definition = definition_for(family)
    write_kohya(weights, {LORA_FILE: "tiny.safetensors"}, definition.kohya, weights, torch.float32, {})
    with safe_open(str(weights / "tiny.safetensors"), "pt") as opened:
        keys = list(opened.keys())
    assert keys and all(key.startswith("lora_unet_") for key in keys)
    assert any("_img_attn_qkv." in key for key in keys), "q, k and v as one fused pair"
    assert not any("transformer_blocks" in key or ".to_" in key for key in keys), "no diffusers module name"

    def loaded(name: str | None):
        pipeline = getattr(diffusers, definition.pipeline).from_pretrained(tiny_model(family))
        if name:
            pipeline.load_lora_weights(str(weights), weight_name=name)
        return pipeline

    ours, theirs, base = loaded(LORA_FILE), loaded("tiny.safetensors"), loaded(None)
    ours_deltas, their_deltas = lora_deltas(ours.transformer), lora_deltas(theirs.transformer)
    assert ours_deltas.keys() <= their_deltas.keys()
    for name, delta in ours_deltas.items():
        torch.testing.assert_close(their_deltas[name], delta, rtol=1e-5, atol=1e-6, msg=name)
    # a part of a fused pair the run did not adapt (FLUX.1 Kontext's add_q_proj, add_v_proj here) comes
    # back as a zero update
    assert all(not their_deltas[name].any() for name in their_deltas.keys() - ours_deltas.keys())

    def transformer_output(pipeline) -> torch.Tensor:
        config, noise = pipeline.transformer.config, torch.Generator().manual_seed(0)
        text = torch.randn(1, 5, config.joint_attention_dim, generator=noise)
        inputs = {"hidden_states": torch.randn(1, 16, config.in_channels, generator=noise),
                  "encoder_hidden_states": text, "timestep": torch.tensor([0.5])}
        if "pooled_projection_dim" in config:  # FLUX.1's transformer
            inputs.update(pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=noise),
                          txt_ids=torch.zeros(5, 3), img_ids=torch.zeros(16, 3), guidance=torch.tensor([2.5]))
        else:
            inputs.update(txt_ids=torch.zeros(1, 5, 4), img_ids=torch.zeros(1, 16, 4),
                          guidance=torch.tensor([4.0]) if config.guidance_embeds else None)
        with torch.no_grad():
            return pipeline.transformer(**inputs, return_dict=False)[0]

    with_ours = transformer_output(ours)
    assert (with_ours - transformer_output(base)).abs().max() > 1e-4, "the LoRA changes the output"
    torch.testing.assert_close(transformer_output(theirs), with_ours, rtol=1e-5, atol=1e-6)


def test_flux1_single_block_linear1_splits_back_at_flux1s_sizes(tmp_path):
    """A single block's q, k, v (its MLP input not adapted) fused into linear1 at FLUX.1's widths, and a
    double block's: diffusers' FLUX.1 converter gives each module its own update back, and the MLP
    input a zero one."""
    rank, width, noise = 2, 3072, torch.Generator().manual_seed(0)
    modules = [f"single_transformer_blocks.37.attn.to_{p}" for p in "qkv"] + \
              [f"transformer_blocks.18.attn.add_{p}_proj" for p in "qkv"] + ["single_transformer_blocks.37.proj_out"]
    inputs = {"single_transformer_blocks.37.proj_out": 5 * width}
    state = {}
    for module in modules:
        state[f"transformer.{module}.lora_A.weight"] = torch.randn(rank, inputs.get(module, width), generator=noise)
        state[f"transformer.{module}.lora_B.weight"] = torch.randn(width, rank, generator=noise)
    (tmp_path / "w").mkdir()
    save_file(state, tmp_path / "w" / LORA_FILE, metadata={
        "lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": 2 * rank})})
    write_kohya(tmp_path / "w", {LORA_FILE: "k.safetensors"}, FLUX_KOHYA, tmp_path / "w", torch.float32, {})
    with safe_open(str(tmp_path / "w" / "k.safetensors"), "pt") as opened:
        assert sorted({key.split(".")[0] for key in opened.keys()}) == [
            "lora_unet_double_blocks_18_txt_attn_qkv", "lora_unet_single_blocks_37_linear1",
            "lora_unet_single_blocks_37_linear2"]
    back = diffusers.FluxKontextPipeline.lora_state_dict(str(tmp_path / "w"), weight_name="k.safetensors")
    for module in modules:
        expected = state[f"transformer.{module}.lora_B.weight"] @ state[f"transformer.{module}.lora_A.weight"] * 2
        found = back[f"transformer.{module}.lora_B.weight"] @ back[f"transformer.{module}.lora_A.weight"]
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-4, msg=module)
    mlp = back["transformer.single_transformer_blocks.37.proj_mlp.lora_B.weight"]
    assert mlp.shape == (4 * width, rank) and not mlp.any(), "the MLP input was not adapted: a zero update"
