"""The published architectures of every family, as config dicts, and folders holding only their configs.

Model hubs are out of reach on our machines, but an architecture is fully described by its
config.json. These are the dimensions of the public checkpoints (stable-diffusion-v1-5,
stable-diffusion-xl-base-1.0, FLUX.1-Kontext-dev, Qwen-Image-Edit, Llama-2-7b, vit-base-patch16-224);
`kubetune plan` builds them on the meta device, benchmarks build them with random weights, and
a config-only folder (`kubetune dev tiny-model --full-size --config-only`) has the standard
diffusers/transformers layout with configs, scheduler and tokenizer stand-ins but no weights.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kubetune_trainer import tiny_models


@dataclass(frozen=True)
class Component:
    """One model of a pipeline: where it lives, which class builds it, and its configuration."""

    subfolder: str          # "" = the folder itself (transformers models such as the classifier)
    library: str            # "diffusers" or "transformers"
    cls: str                # the class name in that library
    config: dict = field(default_factory=dict)


# --- the architectures ------------------------------------------------------------------------

# CLIP ViT-L/14's text tower: SD1.5's text encoder, SDXL's first and FLUX's pooled one (123M).
CLIP_L_TEXT = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=1,
    pad_token_id=1,
)
# OpenCLIP ViT-bigG/14's text tower with its projection: SDXL's second text encoder (695M).
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
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=768, attention_head_dim=8,
)
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
    cross_attention_dim=2048, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
# FLUX.1: 19 double-stream + 38 single-stream blocks, 24 heads x 128, T5 context of width 4096.
FLUX_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), sample_size=1024, use_quant_conv=False, use_post_quant_conv=False,
    shift_factor=0.1159, scaling_factor=0.3611,
)
# T5 v1.1 XXL's encoder (4.76B).
T5_XXL_ENCODER = dict(
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
    pad_token_id=0, eos_token_id=1,
)
# Qwen-Image: 60 dual-stream blocks, 24 heads x 128, context from Qwen2.5-VL-7B (width 3584).
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
LLAMA2_7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)
VIT_B16 = dict(
    image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    intermediate_size=3072, num_labels=1000,
)

SD15 = {
    "unet": Component("unet", "diffusers", "UNet2DConditionModel", SD15_UNET),
    "text_encoder": Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L_TEXT),
    "vae": Component("vae", "diffusers", "AutoencoderKL", SD_VAE),
}
ARCHITECTURES: dict[str, dict[str, Component]] = {
    "sd15": SD15,
    "sdxl": {
        "unet": Component("unet", "diffusers", "UNet2DConditionModel", SDXL_UNET),
        "text_encoder": Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L_TEXT),
        "text_encoder_2": Component("text_encoder_2", "transformers", "CLIPTextModelWithProjection", CLIP_BIGG_TEXT),
        "vae": Component("vae", "diffusers", "AutoencoderKL", {**SD_VAE, "sample_size": 1024,
                                                               "scaling_factor": 0.13025}),
    },
    "flux-kontext": {
        "transformer": Component("transformer", "diffusers", "FluxTransformer2DModel", FLUX_TRANSFORMER),
        "text_encoder": Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L_TEXT),
        "text_encoder_2": Component("text_encoder_2", "transformers", "T5EncoderModel", T5_XXL_ENCODER),
        "vae": Component("vae", "diffusers", "AutoencoderKL", FLUX_VAE),
    },
    "qwen-image-edit": {
        "transformer": Component("transformer", "diffusers", "QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER),
        "text_encoder": Component("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B),
        "vae": Component("vae", "diffusers", "AutoencoderKLQwenImage", QWEN_IMAGE_VAE),
    },
    "pmg": {**SD15, "language_model": Component("language_model", "transformers", "LlamaForCausalLM", LLAMA2_7B)},
    "classifier": {"model": Component("", "transformers", "ViTForImageClassification", VIT_B16)},
}
PIPELINES = {"sd15": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
             "flux-kontext": "FluxKontextPipeline", "qwen-image-edit": "QwenImageEditPipeline",
             "pmg": "StableDiffusionPipeline"}


# --- building ---------------------------------------------------------------------------------

def config_object(component: Component):
    """The transformers config object of a component (diffusers models take the dict itself)."""
    import transformers

    model_cls = getattr(transformers, component.cls)
    return model_cls.config_class(**component.config)


def build(component: Component) -> torch.nn.Module:
    """The component's model, on the current default device (use `with torch.device("meta")`)."""
    if component.library == "diffusers":
        import diffusers

        return getattr(diffusers, component.cls).from_config(component.config)
    import transformers

    return getattr(transformers, component.cls)(config_object(component))


# --- config-only folders ----------------------------------------------------------------------

def _write_component_config(component: Component, out_dir: Path) -> None:
    folder = out_dir / component.subfolder
    folder.mkdir(parents=True, exist_ok=True)
    if component.library == "diffusers":
        with torch.device("meta"):  # the class fills in every default; nothing is allocated
            build(component).save_config(folder)
        return
    config = config_object(component)
    config.architectures = [component.cls]
    config.save_pretrained(folder)


def _scheduler(family: str):
    from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    if family in ("sd15", "pmg"):
        return tiny_models.sd_noise_scheduler()
    if family == "sdxl":
        return EulerDiscreteScheduler(
            num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            prediction_type="epsilon", steps_offset=1, timestep_spacing="leading",
        )
    if family == "flux-kontext":
        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)
    return FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )


def _write_tokenizers(family: str, out_dir: Path) -> None:
    """Stand-in tokenizers (our byte-level ones; hub vocabularies cannot be fetched) at the real lengths."""
    if family in ("sd15", "sdxl", "flux-kontext", "pmg"):
        tiny_models.tiny_clip_tokenizer().save_pretrained(out_dir / "tokenizer")
    if family == "sdxl":
        tiny_models.tiny_clip_tokenizer().save_pretrained(out_dir / "tokenizer_2")
    if family == "flux-kontext":
        tiny_models.tiny_t5_tokenizer(max_length=512).save_pretrained(out_dir / "tokenizer_2")
    if family == "qwen-image-edit":
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

        tokenizer = tiny_models.tiny_qwen2_tokenizer()
        tokenizer.save_pretrained(out_dir / "tokenizer")
        Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                         video_processor=Qwen2VLVideoProcessor()).save_pretrained(out_dir / "processor")
    if family == "pmg":
        tiny_models.tiny_llama_tokenizer().save_pretrained(out_dir / "language_model")


def _write_model_index(family: str, out_dir: Path) -> None:
    """model_index.json, as a pipeline's save_pretrained writes it (the pipeline itself would need weights)."""
    import diffusers

    scheduler = _scheduler(family)
    scheduler.save_pretrained(out_dir / "scheduler")
    index = {"_class_name": PIPELINES[family], "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", type(scheduler).__name__]}
    for name, component in ARCHITECTURES[family].items():
        if name != "language_model":  # PMG's LM sits beside the pipeline, not in it
            index[name] = [component.library, component.cls]
    for name in ("tokenizer", "tokenizer_2", "processor"):
        if (out_dir / name).is_dir():
            index[name] = ["transformers", _saved_class(out_dir / name)]
    if family in ("sd15", "pmg"):
        index.update(safety_checker=[None, None], feature_extractor=[None, None], requires_safety_checker=False)
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _saved_class(folder: Path) -> str:
    for name, key in (("processor_config.json", "processor_class"), ("tokenizer_config.json", "tokenizer_class")):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())[key]
    raise FileNotFoundError(f"{folder}: no tokenizer or processor config")


def write_config_only(family: str, out_dir: Path) -> Path:
    """A folder in the family's standard layout with every config, and no weights."""
    if family not in ARCHITECTURES:
        raise ValueError(f"no reference architecture for family {family!r}; available: {', '.join(ARCHITECTURES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for component in ARCHITECTURES[family].values():
        _write_component_config(component, out_dir)
    if family != "classifier":
        _write_tokenizers(family, out_dir)
        _write_model_index(family, out_dir)
    return out_dir


def write_random_weights(family: str, out_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                         seed: int = 0) -> Path:
    """The family's real architecture with random weights, in its standard layout (for benchmarks:
    speed and memory do not depend on the weights' values). One component at a time is built on
    `device` (a GPU initialises 12B parameters in seconds) and saved in `dtype`."""
    write_config_only(family, out_dir)
    torch.manual_seed(seed)
    for component in ARCHITECTURES[family].values():
        with torch.device(device):
            model = build(component).to(dtype)
        model.save_pretrained(out_dir / component.subfolder if component.subfolder else out_dir,
                              safe_serialization=True)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out_dir
