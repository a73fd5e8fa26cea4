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
from functools import cache, partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kubetune_api.spec_training import PmgSpec
from kubetune_trainer.models import tiny_models
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.families import stable_diffusion as sd
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.trainable import Trainable
from kubetune_trainer.families.planning_forwards import CLIP_TOKENS, mse, vae_scale
from kubetune_trainer.families.components import Component

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
        cache.layers = [prefix_layer_class()(*(prefix[:, layer, i].permute(1, 0, 2).unsqueeze(0).expand(batch_size, -1, -1, -1)
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


@cache
def prefix_layer_class() -> type:
    """PrefixLayer, defined on first use (transformers is imported then, not with this module)."""
    from transformers.cache_utils import DynamicLayer

    class PrefixLayer(DynamicLayer):
        """One LM layer's prefix as a cache layer that attends to prefix + the new keys but stores
        nothing: a gradient-checkpointed layer runs twice and must see the same prefix both times."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

        def update(self, key_states, value_states, *args, **kwargs):
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return PrefixLayer


def adapter_for(pmg: PmgSpec, lm_config, cross_attention_dim: int) -> PmgAdapter:
    """The adapter spec.pmg describes, for an LM of LM_CONFIG and a UNet of CROSS_ATTENTION_DIM."""
    return PmgAdapter(lm_config, pmg.num_image_prompt, pmg.num_prefix_prompt, cross_attention_dim,
                      pmg.prefix_projection, pmg.prefix_hidden_size)


def checkpoint_language_model(language_model) -> None:
    """Gradient checkpointing for the frozen LM: transformers checkpoints only in training mode, so
    the LM is put in it, with its dropout layers kept off (frozen means deterministic). Its layers
    keep the prefix cache under checkpointing (transformers drops a cache there unless told it is
    only read, which PrefixLayer guarantees)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

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


def checkpoint_pmg(models: dict[str, torch.nn.Module]) -> None:
    """Gradient checkpointing of both frozen networks the loss backpropagates through to the trained
    parts: the UNet (to the mapped tokens) and the LM (to the prompts and prefix), whose activations
    dominate. The family and the planner both call it."""
    models["unet"].enable_gradient_checkpointing()
    checkpoint_language_model(models["language_model"])


class PersonalizedGeneration(ModelFamily):
    """Stable Diffusion 1.5's parts (stable_diffusion.UNetDiffusion), all frozen, plus a frozen LM whose
    reading of a user's history, through the trained PmgAdapter, follows the caption's tokens into the UNet."""

    # The LM reads each history through the trained adapter: the step runs it even from a filled cache.
    needed_in_step = ("language_model",)

    def __init__(self, spec, device, weight_dtype):
        # The spec refuses what PMG would ignore (adapter shape, initFrom: kubetune_api.families).
        super().__init__(spec, device, weight_dtype)
        self.pmg = spec.pmg_options
        self.sd = sd.UNetDiffusion(spec, device, weight_dtype, sd.ClipText, sd.SD15_PIPELINE)
        # Frozen, yet in training mode like the UNet the SD1.5 family trains (it has no dropout).
        self.sd.unet.requires_grad_(False).to(device).train()
        lm_path = self.pmg.language_model or f"{spec.model.pretrained}/language_model"
        self.lm_tokenizer, self.language_model = load_language_model(lm_path, weight_dtype)
        cross_attention_dim = self.sd.unet.config.cross_attention_dim
        adapter = adapter_for(self.pmg, self.language_model.config, cross_attention_dim).to(device)
        self.trainable = Trainable(adapter, partial(save_pmg_adapter, {
            "num_image_prompt": self.pmg.num_image_prompt, "num_prefix_prompt": self.pmg.num_prefix_prompt,
            "cross_attention_dim": cross_attention_dim, "max_sequence_length": self.pmg.max_sequence_length,
            "prefix_projection": self.pmg.prefix_projection, "prefix_hidden_size": self.pmg.prefix_hidden_size,
        }), publishable=True, read=lambda folder: adapter.load_state_dict(load_file(folder / ADAPTER_FILE)))

    def frozen_models(self):
        return {**self.sd.frozen_models(), "language_model": self.language_model}

    def enable_gradient_checkpointing(self):
        checkpoint_pmg({"unet": self.sd.unet, "language_model": self.language_model})

    def build_encoders(self):
        return self.sd.encoders("PersonalizedGeneration")  # part of every cached text entry's identity: keep it

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
    def sample_images(self, model, held_out, draw):
        """The first held-out users' target captions drawn with their personal tokens, when the draw
        takes held-out samples (validation: when a CLIP model will score them). Classifier-free guidance contrasts the caption with the
        empty one, both followed by the same personal tokens: guidance strengthens the caption and
        leaves the user's steer as it is."""
        prompts = draw.captions(held_out)
        if not prompts:
            return []
        histories = [history for batch in held_out for history in batch["histories"]][:len(prompts)]
        text = self.sd.encode_prompts(prompts)["prompt_embeds"]
        personal = self.personal_tokens(model, histories).to(text.dtype)
        empty = self.sd.encode_prompts([""] * len(prompts))["prompt_embeds"]
        return self.sd.sampling_pipeline()(prompt_embeds=torch.cat([text, personal], 1),
                                           negative_prompt_embeds=torch.cat([empty, personal], 1),
                                           **self.sd.sampling_options(draw)).images

    @torch.no_grad()
    def sample_base_images(self, model, held_out, draw):
        """Stable Diffusion 1.5 alone: the same captions without any user's tokens (an untrained adapter
        is random, not the base)."""
        prompts = draw.captions(held_out)
        if not prompts:
            return []
        return self.sd.sampling_pipeline()(prompts, **self.sd.sampling_options(draw)).images

    def image_metrics(self, images, held_out, draw, clip):
        return self.sd.clip_metrics(images, held_out, draw, clip)


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

LLAMA2_7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)
ARCHITECTURE = {**sd.SD15_ARCHITECTURE,
                "language_model": Component("language_model", "transformers", "LlamaForCausalLM", LLAMA2_7B)}


def write_tokenizers(out_dir: Path) -> None:
    sd.write_clip_tokenizer(out_dir)
    tiny_models.tiny_llama_tokenizer().save_pretrained(out_dir / "language_model")


def write_tiny_pmg(out_dir: Path, seed: int = 0) -> Path:
    """PMG's parts: the tiny SD1.5 pipeline plus a 2-layer Llama causal LM in language_model/."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sd.write_tiny_sd15(out_dir, seed)
    tokenizer = tiny_models.tiny_llama_tokenizer()
    torch.manual_seed(seed)
    language_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    ))
    language_model.save_pretrained(out_dir / "language_model", safe_serialization=True)
    tokenizer.save_pretrained(out_dir / "language_model")
    return out_dir


def meta_adapter(spec, models: dict[str, torch.nn.Module]) -> None:
    """The planner's PMG trains its adapter, sized from the LM's and the UNet's configs."""
    models["adapter"] = adapter_for(spec.pmg_options, models["language_model"].config,
                                    models["unet"].config.cross_attention_dim)


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """The adapter runs the LM under autocast (it is the prepared module); the frozen UNet runs as loaded,
    and the gradient flows back through both to the soft prompts."""
    unet, options = models["unet"], spec.pmg_options
    batch, side = spec.training.batch_size, spec.resolution // vae_scale(models["vae"])
    history = options.max_sequence_length  # padded to the longest history: assume a full one
    with autocast():
        personal = models["adapter"](models["language_model"], make((batch, history), torch.long),
                                     make((batch, history), torch.long))
    text = make((batch, CLIP_TOKENS, unet.config.cross_attention_dim), dtype)
    noisy = make((batch, unet.config.in_channels, side, side), dtype)
    prediction = unet(noisy, make((batch,), torch.long),
                      encoder_hidden_states=torch.cat([text, personal.to(dtype)], 1)).sample
    return mse(prediction, noisy)


DEFINITION = FamilyDefinition(
    family=PersonalizedGeneration,
    architecture=ARCHITECTURE,
    trained="adapter",
    quantized="unet",  # the frozen SD1.5 UNet
    forward=planning_forward,
    write_tiny=write_tiny_pmg,
    pipeline=sd.SD15_PIPELINE,
    scheduler=sd.sd15_scheduler,
    write_tokenizers=write_tokenizers,
    model_index=sd.SD15_MODEL_INDEX,
    beside_pipeline=frozenset({"language_model"}),  # the LM sits beside the SD1.5 pipeline, not in it
    auto_classes={"language_model": "AutoModelForCausalLM"},
    elsewhere={"language_model": ("spec.pmg.languageModel", lambda spec: spec.pmg and spec.pmg.language_model)},
    meta_trainable=meta_adapter,
    checkpointing=checkpoint_pmg,
)
