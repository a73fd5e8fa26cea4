"""What a family's pipeline is made of: Component (a model's class and config), the published configs
several families share (CLIP text towers, T5 XXL, the SD VAE, Qwen-Image's parts, Qwen3-4B), and the
model built from one.

Each family declares its reference architecture in its module (DEFINITION.architecture, from the
dimensions of its public checkpoint) out of these; kubetune_trainer.models.reference_models writes
config-only folders of them, `kubetune plan` builds them on the meta device. Importing this stays cheap:
diffusers and transformers are imported by the functions that build.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Component:
    """One model of a pipeline: where it lives, which class builds it, and its configuration."""

    subfolder: str          # "" = the folder itself (transformers models such as the classifier)
    library: str            # "diffusers" or "transformers"
    cls: str                # the class name in that library
    config: dict = field(default_factory=dict)


# --- published configs shared by several models ---------------------------------------------------

# CLIP ViT-L/14's text tower: SD1.5's text encoder, SDXL's first and FLUX's pooled one (123M).
CLIP_L_TEXT = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=1,
    pad_token_id=1,
)
# OpenCLIP ViT-bigG/14's text tower with its projection: SDXL's second text encoder, SD3's (695M).
CLIP_BIGG_TEXT = dict(
    vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    max_position_embeddings=77, hidden_act="gelu", projection_dim=1280, bos_token_id=0, eos_token_id=1,
    pad_token_id=1,
)
# The 8x-downsampling KL autoencoder of SD1.5 and SDXL (84M); FLUX's has 16 latent channels.
SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), sample_size=512, scaling_factor=0.18215,
)
# T5 v1.1 XXL's encoder (4.76B): FLUX.1's and SD3's.
T5_XXL_ENCODER = dict(
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
    pad_token_id=0, eos_token_id=1,
)
# Qwen-Image's parts, which Qwen-Image-Edit and its 2509/2511 versions share: 60 dual-stream blocks,
# 24 heads x 128, context from Qwen2.5-VL-7B (width 3584).
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE_VAE: dict = {}  # AutoencoderKLQwenImage's defaults are the published model (base_dim 96, z_dim 16)
QWEN25_VL_7B = dict(
    text_config={
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643,
    },
    vision_config={
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 3584,
        "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
    },
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False,
)

# Qwen3-4B (4.02B): its hidden states are the context of FLUX.2 [klein] 4B (Qwen3ForCausalLM) and of
# Z-Image (Qwen3Model, the same without the LM head, which the tied embeddings make weightless).
QWEN3_4B = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=151643, eos_token_id=151645,
)

# --- building ---------------------------------------------------------------------------------

def config_object(component: Component):
    """The transformers config object of a component (diffusers models take the dict itself)."""
    import transformers

    model_cls = getattr(transformers, component.cls)
    return model_cls.config_class(**component.config)


def build(component: Component) -> "torch.nn.Module":
    """The component's model, on the current default device (use `with torch.device("meta")`)."""
    if component.library == "diffusers":
        import diffusers

        return getattr(diffusers, component.cls).from_config(component.config)
    import transformers

    return getattr(transformers, component.cls)(config_object(component))
