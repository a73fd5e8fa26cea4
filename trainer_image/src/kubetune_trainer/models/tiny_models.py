"""Tiny random-weight models in the standard diffusers/transformers layouts.

Nothing can be downloaded from a model hub on our test machines, so tests and demos build small
models from configs of the real classes, save them with `save_pretrained`, and the trainer loads
them back through the same `from_pretrained` path it uses for real weights. Each family writes its
own (its DEFINITION.write_tiny, in its module) from the parts here: tokenizers built without
downloads, a tiny CLIP text encoder, VAE and UNet; write_tiny_model finds the family's writer.
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


QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>")


def tiny_qwen2_tokenizer():
    """A Qwen2 byte-level BPE tokenizer over single bytes (no merges) plus the chat and vision tokens."""
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(_byte_to_unicode().values())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=1024)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    return tokenizer


# Enough of Qwen3's chat template for one user turn: add_generation_prompt opens the assistant's turn and
# enable_thinking=False (what FLUX.2 [klein] passes; Z-Image passes true) closes an empty think block, as
# Qwen3's does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def tiny_qwen3_tokenizer():
    """The Qwen2 byte-level tokenizer with Qwen3's think tokens and (enough of) its chat template."""
    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*QWEN_SPECIAL_TOKENS, "<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]")
# The shape of Mistral-Small-3.x's template: a system prompt, then user turns whose content is a list of
# {"type": "text" | "image"} parts (how diffusers' Flux2Pipeline builds its messages).
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- if message['content'] is not string %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{- '[IMG]' }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- text + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text + eos_token }}{%- endif %}{%- endfor %}"
)


def tiny_pixtral_processor():
    """A PixtralProcessor (what FLUX.2 [dev] keeps in its `tokenizer` slot) over a byte-level tokenizer with
    Mistral's control tokens and chat template, and an image processor for 64-pixel images."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    specials = {token: i for i, token in enumerate(MISTRAL_SPECIAL_TOKENS)}
    vocab = specials | {symbol: len(specials) + i for i, symbol in enumerate(_byte_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", model_max_length=131072, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": list(MISTRAL_SPECIAL_TOKENS[4:])})
    return PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": 64}, patch_size=8),
                            tokenizer=tokenizer, patch_size=8, spatial_merge_size=2,
                            chat_template=MISTRAL_CHAT_TEMPLATE)


def tiny_llama_tokenizer():
    """A subword tokenizer for the LM (any will do for random weights): the T5-style one, generic class."""
    from transformers import PreTrainedTokenizerFast

    t5_style = tiny_t5_tokenizer(max_length=256)
    return PreTrainedTokenizerFast(tokenizer_object=t5_style.backend_tokenizer, eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=256)


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


def write_tiny_model(family: str, out_dir: Path, seed: int = 0, full_size: bool = False,
                     config_only: bool = False) -> Path:
    """Write a random-weight model of `family` into `out_dir` (created); returns the directory.

    The writers are the family's own (DEFINITION.write_tiny / write_full_size: families.definition).
    full_size=True writes the real architecture instead of the toy one; config_only=True writes
    the real architecture's configs without weights (every family: what `kubetune plan` reads).
    """
    from kubetune_api.families import FAMILIES
    from kubetune_trainer.families import definition_for, definitions

    if config_only:
        from kubetune_trainer.models.reference_models import write_config_only

        return write_config_only(family, out_dir)
    kind = "write_full_size" if full_size else "write_tiny"
    writer = getattr(definition_for(family), kind) if family in FAMILIES else None
    if writer is None:
        available = [name for name, definition in definitions().items() if getattr(definition, kind)]
        raise ValueError(f"no {'full-size' if full_size else 'tiny'} model for family {family!r}; "
                         f"available: {', '.join(available)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    return writer(out_dir, seed=seed)
