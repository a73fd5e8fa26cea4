"""lora_keys: a diffusers LoRA file's tensors under another tool's names, and what cannot be converted."""
from __future__ import annotations

import json

import pytest
import torch

from kubetune_trainer.families import definitions
from kubetune_trainer.results.lora_keys import (DIFFUSION_MODEL, FLUX2_KOHYA, FLUX_KOHYA, KOHYA_UNET, WAN_ORIGINAL,
                                       UnconvertibleLora, to_convention)


def metadata(component: str, alpha: float, **more) -> dict[str, str]:
    return {"lora_adapter_metadata": json.dumps({f"{component}.lora_alpha": alpha, f"{component}.r": 2,
                                                 **{f"{component}.{k}": v for k, v in more.items()}})}


def pair(name: str, spelling: tuple[str, str] = (".lora.down.weight", ".lora.up.weight")) -> dict:
    return {name + spelling[0]: torch.ones(2, 3), name + spelling[1]: torch.full((4, 2), 0.5)}


@pytest.mark.parametrize("convention, component, module, key", [
    (KOHYA_UNET, "unet", "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0",
     "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0"),
    (DIFFUSION_MODEL, "transformer", "transformer_blocks.3.attn.add_q_proj",
     "diffusion_model.transformer_blocks.3.attn.add_q_proj"),
    (WAN_ORIGINAL, "transformer", "blocks.12.attn1.to_out.0", "diffusion_model.blocks.12.self_attn.o"),
    (WAN_ORIGINAL, "transformer", "blocks.0.attn2.add_k_proj", "diffusion_model.blocks.0.cross_attn.k_img"),
    (WAN_ORIGINAL, "transformer", "blocks.1.ffn.net.0.proj", "diffusion_model.blocks.1.ffn.0"),
    (FLUX_KOHYA, "transformer", "transformer_blocks.18.attn.to_out.0", "lora_unet_double_blocks_18_img_attn_proj"),
    (FLUX_KOHYA, "transformer", "single_transformer_blocks.37.proj_out", "lora_unet_single_blocks_37_linear2"),
    (FLUX2_KOHYA, "transformer", "single_transformer_blocks.2.attn.to_qkv_mlp_proj", "lora_unet_single_blocks_2_linear1"),
    (FLUX2_KOHYA, "transformer", "transformer_blocks.0.ff_context.linear_out", "lora_unet_double_blocks_0_txt_mlp_2"),
    # What the two FLUX conventions share is written once, with each one's own MLP and embedder names.
    (FLUX_KOHYA, "transformer", "transformer_blocks.4.ff_context.net.0.proj", "lora_unet_double_blocks_4_txt_mlp_0"),
    (FLUX_KOHYA, "transformer", "time_text_embed.guidance_embedder.linear_2", "lora_unet_guidance_in_out_layer"),
    (FLUX2_KOHYA, "transformer", "time_guidance_embed.timestep_embedder.linear_1", "lora_unet_time_in_in_layer"),
    (FLUX2_KOHYA, "transformer", "proj_out", "lora_unet_final_layer_linear"),
])
def test_each_pair_gets_the_tools_name_with_its_alpha(convention, component, module, key):
    converted = to_convention(pair(f"{component}.{module}"), metadata(component, 8.0), convention, torch.bfloat16)
    assert sorted(converted) == sorted(key + end for end in (".lora_down.weight", ".lora_up.weight", ".alpha"))
    assert converted[key + ".alpha"].item() == 8.0
    assert {value.dtype for value in converted.values()} == {torch.bfloat16}
    torch.testing.assert_close(converted[key + ".lora_up.weight"], torch.full((4, 2), 0.5, dtype=torch.bfloat16))


def test_peft_spelled_files_convert_too():
    converted = to_convention(pair("unet.mid_block.attentions.0.proj_in", (".lora_A.weight", ".lora_B.weight")),
                              metadata("unet", 2.0), KOHYA_UNET, torch.float32)
    assert "lora_unet_mid_block_attentions_0_proj_in.lora_down.weight" in converted


@pytest.mark.parametrize("state, meta, convention, message", [
    (pair("transformer.blocks.0.norm2"), metadata("transformer", 2.0), WAN_ORIGINAL,
     "has no name for the adapted module 'blocks.0.norm2'"),
    (pair("transformer.norm_out.linear"), metadata("transformer", 2.0), FLUX_KOHYA,
     "has no name for the adapted module 'norm_out.linear'"),
    (pair("transformer.x.to_q"), metadata("transformer", 2.0), KOHYA_UNET,
     "has no name for LoRA weights of 'transformer'"),
    (pair("unet.x.to_q"), {}, KOHYA_UNET, "no LoRA config (lora_adapter_metadata): its alpha is unknown"),
    (pair("unet.x.to_q"), metadata("unet", 2.0, rank_pattern={"to_q": 4}), KOHYA_UNET,
     "per-module ranks or alphas are not exported"),
    ({"unet.x.to_q.lora.down.weight": torch.ones(2, 3)}, metadata("unet", 2.0), KOHYA_UNET,
     "unet.x.to_q has a LoRA down or up weight without the other"),
    ({**pair("unet.x.to_q"), "unet.x.to_q.lora_magnitude_vector": torch.ones(4)}, metadata("unet", 2.0), KOHYA_UNET,
     "is not a LoRA down/up weight"),
])
def test_what_a_convention_cannot_express_is_refused_naming_it(state, meta, convention, message):
    with pytest.raises(UnconvertibleLora, match=message.replace("(", r"\(").replace(")", r"\)")):
        to_convention(state, meta, convention, torch.float32)


def test_a_family_declaring_a_convention_saves_its_lora_under_a_component_the_convention_names():
    """Its LoRA file's keys start with the trained component's name (families.trainable)."""
    declared = {name: d for name, d in definitions().items() if d.kohya is not None}
    assert {"sd15", "sdxl", "qwen-image", "z-image", "wan"} <= declared.keys()
    for name, definition in declared.items():
        assert definition.trained in definition.kohya.prefixes, name


def test_flux_fuses_q_k_v_into_one_pair_whose_parts_keep_their_own_update():
    """Down weights stacked, up weights block-diagonal, alpha x the parts so alpha / rank stays the
    parts' own; a part not adapted (v here) is a zero block."""
    state = {**pair("transformer.transformer_blocks.1.attn.to_q"), **pair("transformer.transformer_blocks.1.attn.to_k")}
    state["transformer.transformer_blocks.1.attn.to_k.lora.up.weight"] = torch.full((4, 2), 2.0)
    converted = to_convention(state, metadata("transformer", 8.0), FLUX_KOHYA, torch.float32)
    name = "lora_unet_double_blocks_1_img_attn_qkv"
    assert sorted(converted) == sorted(name + end for end in (".lora_down.weight", ".lora_up.weight", ".alpha"))
    down, up = converted[name + ".lora_down.weight"], converted[name + ".lora_up.weight"]
    assert down.shape == (6, 3) and up.shape == (12, 6) and converted[name + ".alpha"].item() == 24.0
    scale = converted[name + ".alpha"].item() / down.shape[0]
    update = up @ down * scale  # what the tools add to the fused qkv weight
    torch.testing.assert_close(update[0:4], torch.full((4, 2), 0.5) @ torch.ones(2, 3) * 4.0)
    torch.testing.assert_close(update[4:8], torch.full((4, 2), 2.0) @ torch.ones(2, 3) * 4.0)
    assert not update[8:12].any(), "v was not adapted"
