"""PMG, personalized generation: a frozen LLaMA-style LM reads a user's history and steers a frozen
Stable Diffusion 1.5 through trained soft prompts.

Trained: image-prompt tokens appended after the history, a P-Tuning v2 prefix (each LM layer's
first keys and values, trained directly; through an MLP only with spec.pmg.prefixProjection), and
a mapping layer from the LM's hidden size to the UNet's text-embedding size. The UNet sees the
target caption's CLIP embedding followed by the mapped image-prompt states; the loss is SD's
noise-prediction MSE. At LLaMA-2-7B and SD1.5 sizes that is about 3.7M trained parameters with the
defaults (the prefix projection would add about 1.1 billion).
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from kubetune_api.spec import PmgSpec
from kubetune_trainer.device_copy import to_device
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.sd15 import UNetDiffusion
from kubetune_trainer.families.trainable import Trainable

ADAPTER_FILE = "pmg_adapter.safetensors"
ADAPTER_CONFIG = "pmg_adapter.json"


class PmgAdapter(torch.nn.Module):
    """Everything PMG trains; `forward` runs the frozen LM with it and returns UNet-ready tokens."""

    def __init__(self, lm_config, num_image_prompt: int, num_prefix_prompt: int, cross_attention_dim: int,
                 prefix_projection: bool = False, prefix_hidden_size: int | None = None):
        super().__init__()
        hidden = lm_config.hidden_size
        self.num_layers = lm_config.num_hidden_layers
        self.num_kv_heads = getattr(lm_config, "num_key_value_heads", None) or lm_config.num_attention_heads
        self.head_dim = getattr(lm_config, "head_dim", None) or hidden // lm_config.num_attention_heads
        self.num_prefix_prompt = num_prefix_prompt
        per_token = self.num_layers * 2 * self.num_kv_heads * self.head_dim  # every layer's key and value
        self.image_prompt = torch.nn.Parameter(torch.randn(num_image_prompt, hidden) * 0.02)
        if prefix_projection:
            # P-Tuning v2's reparameterisation: a token embedding through an MLP to every layer's keys
            # and values (steadier at first, but the last Linear is hidden x per_token weights).
            self.prefix_tokens = torch.nn.Embedding(num_prefix_prompt, hidden)
            self.prefix_encoder = torch.nn.Sequential(
                torch.nn.Linear(hidden, prefix_hidden_size or hidden), torch.nn.Tanh(),
                torch.nn.Linear(prefix_hidden_size or hidden, per_token),
            )
        else:
            self.prefix = torch.nn.Embedding(num_prefix_prompt, per_token)
            torch.nn.init.normal_(self.prefix.weight, std=0.02)
        self.mapping = torch.nn.Sequential(torch.nn.Linear(hidden, cross_attention_dim),
                                           torch.nn.LayerNorm(cross_attention_dim))

    def prefix_values(self) -> torch.Tensor:
        """[prefix length, layers * 2 * kv heads * head dim]: each prefix token's keys and values."""
        if hasattr(self, "prefix"):
            return self.prefix.weight
        return self.prefix_encoder(self.prefix_tokens.weight)

    def prefix_cache(self, batch_size: int, dtype: torch.dtype):
        from transformers import DynamicCache

        prefix = self.prefix_values()
        length = prefix.shape[0]
        prefix = prefix.view(length, self.num_layers, 2, self.num_kv_heads, self.head_dim).to(dtype)
        cache = DynamicCache()
        cache.layers = [PrefixLayer(*(prefix[:, layer, i].permute(1, 0, 2).unsqueeze(0).expand(batch_size, -1, -1, -1)
                                       for i in (0, 1)))
                        for layer in range(self.num_layers)]
        return cache

    def forward(self, language_model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch_size = input_ids.shape[0]
        embeds = language_model.get_input_embeddings()(input_ids)
        prompt = self.image_prompt.to(embeds.dtype).unsqueeze(0).expand(batch_size, -1, -1)
        inputs = torch.cat([embeds, prompt], dim=1)
        cache = self.prefix_cache(batch_size, embeds.dtype)
        prefix_length = self.num_prefix_prompt
        prefix_mask = attention_mask.new_ones(batch_size, prefix_length)
        token_mask = torch.cat([attention_mask, attention_mask.new_ones(batch_size, prompt.shape[1])], dim=1)
        # Positions count real tokens only, after the prefix: a history reads the same whatever
        # padding the longest history of its batch forced on it (so the batch's split never matters).
        positions = (prefix_length + token_mask.long().cumsum(dim=1) - 1).clamp(min=prefix_length)
        hidden = language_model.model(
            inputs_embeds=inputs, attention_mask=torch.cat([prefix_mask, token_mask], dim=1),
            position_ids=positions, past_key_values=cache, use_cache=False,
        ).last_hidden_state[:, -prompt.shape[1]:]
        return self.mapping(hidden.float())


class PrefixLayer(DynamicLayer):
    """One LM layer's prefix as a cache layer that attends to prefix + the new keys but stores
    nothing: a gradient-checkpointed layer runs twice and must see the same prefix both times."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def adapter_for(pmg: PmgSpec, lm_config, cross_attention_dim: int) -> PmgAdapter:
    """The adapter spec.pmg describes, for an LM of LM_CONFIG and a UNet of CROSS_ATTENTION_DIM."""
    return PmgAdapter(lm_config, pmg.num_image_prompt, pmg.num_prefix_prompt, cross_attention_dim,
                      pmg.prefix_projection, pmg.prefix_hidden_size)


def checkpoint_language_model(language_model) -> None:
    """Gradient checkpointing for the frozen LM: transformers checkpoints only in training mode, so
    the LM is put in it, with its dropout layers kept off (frozen means deterministic). Its layers
    keep the prefix cache under checkpointing (transformers drops a cache there unless told it is
    only read, which PrefixLayer guarantees)."""
    language_model.gradient_checkpointing_enable()
    language_model.train()
    for module in language_model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True


def load_language_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # the image prompt then follows the history directly
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def load_pmg_adapter(folder: Path, language_model) -> PmgAdapter:
    """The saved trainable parts, ready to condition a StableDiffusionPipeline via prompt_embeds."""
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    adapter = PmgAdapter(language_model.config, config["num_image_prompt"], config["num_prefix_prompt"],
                         config["cross_attention_dim"], config.get("prefix_projection", True),
                         config.get("prefix_hidden_size"))  # older adapters always projected
    adapter.load_state_dict(load_file(folder / ADAPTER_FILE))
    return adapter


def save_pmg_adapter(config: dict, out_dir: Path, trained: dict[str, torch.Tensor]) -> list[Path]:
    """The trained parts and the sizes load_pmg_adapter needs to rebuild them."""
    save_file({k: v.detach().cpu().contiguous() for k, v in trained.items()}, out_dir / ADAPTER_FILE)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return [out_dir / ADAPTER_FILE, out_dir / ADAPTER_CONFIG]


class PersonalizedGeneration(ModelFamily):
    """Stable Diffusion 1.5's parts (sd15.UNetDiffusion), all frozen, plus a frozen LM whose reading
    of a user's history, through the trained PmgAdapter, follows the caption's tokens into the UNet."""

    def __init__(self, spec, device, weight_dtype):
        # The spec refuses what PMG would ignore (adapter shape, initFrom: kubetune_api.families).
        super().__init__(spec, device, weight_dtype)
        self.pmg = spec.pmg_options
        self.sd = UNetDiffusion(spec, device, weight_dtype)
        # Frozen, yet in training mode like the UNet the SD1.5 family trains (it has no dropout).
        self.sd.unet.requires_grad_(False).to(device).train()
        lm_path = self.pmg.language_model or f"{spec.model.pretrained}/language_model"
        self.lm_tokenizer, self.language_model = load_language_model(lm_path, weight_dtype)
        self.language_model.requires_grad_(False).to(device).eval()
        cross_attention_dim = self.sd.unet.config.cross_attention_dim
        adapter = adapter_for(self.pmg, self.language_model.config, cross_attention_dim).to(device)
        self.trainable = Trainable(adapter, partial(save_pmg_adapter, {
            "num_image_prompt": self.pmg.num_image_prompt, "num_prefix_prompt": self.pmg.num_prefix_prompt,
            "cross_attention_dim": cross_attention_dim, "max_sequence_length": self.pmg.max_sequence_length,
            "prefix_projection": self.pmg.prefix_projection, "prefix_hidden_size": self.pmg.prefix_hidden_size,
        }), publishable=True)

    def enable_gradient_checkpointing(self):
        """Both frozen networks the loss backpropagates through to the trained parts: the UNet (to
        the mapped tokens) and the LM (to the prompts and prefix), whose activations dominate."""
        self.sd.unet.enable_gradient_checkpointing()
        checkpoint_language_model(self.language_model)

    def build_encoders(self):
        return self.sd.encoders(type(self).__name__)

    def encode_batch(self, batch):
        return self.encode_images_and_captions(batch)

    def personal_tokens(self, adapter, histories: list[str]) -> torch.Tensor:
        """What `adapter` (the prepared PmgAdapter) maps the LM's reading of each history to."""
        tokens = self.lm_tokenizer(histories, padding=True, truncation=True,
                                   max_length=self.pmg.max_sequence_length, return_tensors="pt")
        return adapter(self.language_model, to_device(tokens.input_ids, self.device),
                       to_device(tokens.attention_mask, self.device))

    def compute_loss(self, model, batch, random):
        personal = self.personal_tokens(model, batch["histories"])
        return self.sd.loss(self.sd.unet, batch, self.encode_batch(batch), random, extra_tokens=personal)

    @torch.no_grad()
    def sample_images(self, model, held_out, generator):
        """The first held-out users' target captions drawn with their personal tokens, when a CLIP model
        will score them (validation_prompts). Classifier-free guidance contrasts the caption with the
        empty one, both followed by the same personal tokens: guidance strengthens the caption and
        leaves the user's steer as it is."""
        prompts = self.sd.validation_prompts(held_out)
        if not prompts:
            return []
        histories = [history for batch in held_out for history in batch["histories"]][:len(prompts)]
        text = self.sd.encode_prompts(prompts)["prompt_embeds"]
        personal = self.personal_tokens(model, histories).to(text.dtype)
        empty = self.sd.encode_prompts([""] * len(prompts))["prompt_embeds"]
        return self.sd.sampling_pipeline()(prompt_embeds=torch.cat([text, personal], 1),
                                           negative_prompt_embeds=torch.cat([empty, personal], 1),
                                           **self.sd.sampling_options(generator)).images

    def image_metrics(self, images, held_out, clip):
        return self.sd.clip_metrics(images, held_out, clip)
