"""Tiny random-weight models in the standard diffusers/transformers layouts.

Nothing can be downloaded from a model hub on our test machines, so tests and demos build small
models from configs of the real classes, save them with `save_pretrained`, and the trainer loads
them back through the same `from_pretrained` path it uses for real weights.
"""
from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shift)
            shift += 1
    return mapping


def tiny_clip_tokenizer():
    """A CLIP tokenizer whose vocabulary is every byte, alone and word-final: no merges needed.

    It splits words into characters, which is all a random-weight text encoder can use.
    """
    from transformers import CLIPTokenizer

    symbols = list(_byte_to_unicode().values())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *symbols, *(s + "</w>" for s in symbols)])}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def tiny_clip_text_encoder(vocab_size: int, hidden_size: int = 32, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return CLIPTextModel(config)


def tiny_vae(seed: int = 0):
    """A two-level VAE: latents are half the image size (the real one: an eighth)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 32), layers_per_block=1, norm_num_groups=32, sample_size=32,
    )


def tiny_sd_unet(cross_attention_dim: int = 32, seed: int = 0):
    """The SD1.5 UNet architecture (cross-attention down/up blocks) at toy width."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim, attention_head_dim=8, norm_num_groups=32,
    )


def sd_noise_scheduler():
    """The DDPM training scheduler SD1.5 ships with."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", clip_sample=False, steps_offset=1,
    )


def write_tiny_sd15(out_dir: Path, seed: int = 0) -> Path:
    from diffusers import StableDiffusionPipeline

    tokenizer = tiny_clip_tokenizer()
    pipeline = StableDiffusionPipeline(
        vae=tiny_vae(seed),
        text_encoder=tiny_clip_text_encoder(len(tokenizer), seed=seed),
        tokenizer=tokenizer,
        unet=tiny_sd_unet(seed=seed),
        scheduler=sd_noise_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def write_full_size_sd15(out_dir: Path, seed: int = 0) -> Path:
    """The real SD1.5 architecture (860M-parameter UNet, ViT-L/14 text encoder) with random weights.

    For GPU benchmarks: throughput does not depend on the weights' values.
    """
    from diffusers import StableDiffusionPipeline

    from kubetune_trainer.reference_models import SD15, build

    torch.manual_seed(seed)
    models = {name: build(component) for name, component in SD15.items()}
    pipeline = StableDiffusionPipeline(
        **models, tokenizer=tiny_clip_tokenizer(), scheduler=sd_noise_scheduler(), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def tiny_sdxl_unet(seed: int = 0):
    """The SDXL UNet (text_time additional conditioning, linear projections) at toy width."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64, norm_num_groups=32,
    )


def write_tiny_sdxl(out_dir: Path, seed: int = 0) -> Path:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", steps_offset=1, timestep_spacing="leading",
    )
    pipeline = StableDiffusionXLPipeline(
        vae=tiny_vae(seed), text_encoder=tiny_clip_text_encoder(len(tokenizer), seed=seed), tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer, unet=tiny_sdxl_unet(seed), scheduler=scheduler,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def write_tiny_classifier(out_dir: Path, seed: int = 0) -> Path:
    """A ViT image classifier (2 labels; training replaces the head to fit the data's classes)."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(seed)
    model = ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=2,
    ))
    model.save_pretrained(out_dir, safe_serialization=True)
    # Real checkpoints ship their preprocessing: the size and normalisation the model expects.
    ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(out_dir)
    return out_dir


def tiny_t5_tokenizer(max_length: int = 32):
    """A T5 tokenizer (sentencepiece-style unigram) over printable ASCII, built without downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(chr(c), -1.0) for c in range(32, 127)] + [("▁", -1.0)]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           extra_ids=0, model_max_length=max_length)


def write_tiny_flux_kontext(out_dir: Path, seed: int = 0) -> Path:
    """FLUX.1 Kontext's pipeline: a 1+1-block FluxTransformer2DModel, a 2-level 4-channel VAE, CLIP + T5."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0))
    pipeline = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=vae,
        text_encoder=tiny_clip_text_encoder(len(clip_tokenizer), seed=seed), tokenizer=clip_tokenizer,
        text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer,
    )
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>")


def tiny_qwen2_tokenizer():
    """A Qwen2 byte-level BPE tokenizer over single bytes (no merges) plus the chat and vision tokens."""
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(_byte_to_unicode().values())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=1024)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    return tokenizer


def write_tiny_qwen_image_edit(out_dir: Path, seed: int = 0) -> Path:
    """Qwen-Image-Edit's pipeline: a 1-block QwenImageTransformer2DModel, an 8x AutoencoderKLQwenImage,
    a 2-layer Qwen2.5-VL text encoder with a 2-block vision tower, and the Qwen2-VL processor."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                           QwenImageTransformer2DModel)
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    tokenizer = tiny_qwen2_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    ))
    # The vision tower sees at most 112x112 pixels: 16 patches, 4 tokens after the 2x2 merge.
    pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(**pixels))
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    pipeline = QwenImageEditPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                     processor=processor, transformer=transformer)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def tiny_llama_tokenizer():
    """A subword tokenizer for the LM (any will do for random weights): the T5-style one, generic class."""
    from transformers import PreTrainedTokenizerFast

    t5_style = tiny_t5_tokenizer(max_length=256)
    return PreTrainedTokenizerFast(tokenizer_object=t5_style.backend_tokenizer, eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=256)


def write_tiny_pmg(out_dir: Path, seed: int = 0) -> Path:
    """PMG's parts: the tiny SD1.5 pipeline plus a 2-layer Llama causal LM in language_model/."""
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tiny_sd15(out_dir, seed)
    tokenizer = tiny_llama_tokenizer()
    torch.manual_seed(seed)
    language_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    ))
    language_model.save_pretrained(out_dir / "language_model", safe_serialization=True)
    tokenizer.save_pretrained(out_dir / "language_model")
    return out_dir


def write_tiny_clip(out_dir: Path, seed: int = 0) -> Path:
    """A CLIP model (text and 32-pixel vision towers, 16-d projections) with its tokenizer and image
    processor: what spec.validation.clipModel loads (CLIPModel / CLIPProcessor.from_pretrained)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 77,
                     "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    ))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # The real processors resize and centre-crop to the vision tower's size (224): here 32.
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out_dir)
    return out_dir


WRITERS = {"sd15": write_tiny_sd15, "sdxl": write_tiny_sdxl, "classifier": write_tiny_classifier,
           "flux-kontext": write_tiny_flux_kontext, "qwen-image-edit": write_tiny_qwen_image_edit,
           "pmg": write_tiny_pmg}
FULL_SIZE_WRITERS = {"sd15": write_full_size_sd15}


def write_tiny_model(family: str, out_dir: Path, seed: int = 0, full_size: bool = False,
                     config_only: bool = False) -> Path:
    """Write a random-weight model of `family` into `out_dir` (created); returns the directory.

    full_size=True writes the real architecture instead of the toy one; config_only=True writes
    the real architecture's configs without weights (every family: what `kubetune plan` reads).
    """
    if config_only:
        from kubetune_trainer.reference_models import write_config_only

        return write_config_only(family, out_dir)
    writers = FULL_SIZE_WRITERS if full_size else WRITERS
    if family not in writers:
        raise ValueError(f"no {'full-size' if full_size else 'tiny'} model for family {family!r}; "
                         f"available: {', '.join(writers)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    return writers[family](out_dir, seed=seed)
