"""FLUX.2's parts, composed by the two FLUX.2 families (flux2: [dev]; flux2-klein: [klein] 4B/9B).

`Flux2Diffusion` is FLUX.2 itself: the Flux2Transformer2DModel (loaded, quantized and trained through
families.denoiser, LoRA on every block's attention: lora_targets), the AutoencoderKLFlux2 and what
they do: the VAE's latents cut into 2x2 patches and normalised by the VAE's batch-norm statistics,
packed into tokens with (t, h, w, l) position ids, reference images' tokens appended with t = 10, 20,
..., and the flow-matching loss on the target's tokens. What [dev] and [klein] do differently is their
text part, passed in (flux2.MistralText, flux2_klein.Qwen3Text): the text encoder and its prompt
template, which of its hidden layers make the prompt embedding, the guidance value the transformer
trains with, and how the pipeline samples.

A batch shares one geometry: the transformer reads the position ids of the batch's first sample
only (diffusers' Flux2Transformer2DModel takes ids[0] of 3-D ids), so every sample of a batch has the
same target size, the same number of references and the same reference sizes. The layouts keep it
so: without bucketing every image is cropped to spec.data.resolution (one size for all); with
bucketing the sampler takes a step's samples from one bucket, and an edit pair's control images are
cut to their target's bucket size; edit pairs with different numbers of control images never share
a step (the sampler groups them by count); the prompt is always 512 tokens. batch_references
refuses a batch that breaks it.

References: with the captions layout a sample has none (plain text-to-image); with edit-pairs its
control images (control_images/NAME.* or NAME_0.*, NAME_1.*, ...; at most the row's max_references)
are its reference images, in order: the i-th at position-id time 10 (i + 1), as the pipelines place
them (`control_values` [B, references, 3, H, W]).
"""
from __future__ import annotations

from typing import Any

import torch

from kubetune_api.data_layouts import DATA_LAYOUTS
from kubetune_trainer.training import diffusion, flow_matching, quantization
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.results.drawing import Draw
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.denoiser import load_denoiser, train_denoiser
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.families.planning_forwards import mse, vae_scale
from kubetune_trainer.training.randomness import SampleRandom
from kubetune_trainer.families.components import Component

MAX_TEXT_TOKENS = 512       # both pipelines pad every prompt to 512 tokens and pass no mask: train as they sample
REFERENCE_TIME_STEP = 10    # reference i (from 0) sits at position-id time (i + 1) * 10; the target at 0
MIN_REFERENCE_SIDE = 64     # the pipelines refuse smaller reference images (Flux2ImageProcessor.check_image_input)


# --- published configs both families share --------------------------------------------------------

FLUX2_VAE: dict = {}  # AutoencoderKLFlux2's defaults are the published VAE (32 latent channels, 8x, batch-norm stats)


def transformer_config(**sizes) -> dict:
    """A published Flux2Transformer2DModel config: FLUX.2's fixed parts and the variant's sizes."""
    return dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, **sizes)


def scheduler():
    """The flow-matching scheduler both pipelines ship (FLUX.1-dev's config). At sampling the pipelines
    pass their own shift (compute_empirical_mu of the image's tokens and the step count)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def lora_targets(transformer: torch.nn.Module) -> list[str]:
    """The default LoRA targets: every block's attention, as diffusers' FLUX.2 LoRA examples adapt it.

    A double-stream block has separate image-stream projections to_q, to_k, to_v and to_out (a
    ModuleList there: to_out.0); a single-stream block fuses q, k, v with the MLP's input
    (to_qkv_mlp_proj) and the attention's output with the MLP's (to_out, a plain Linear there, named
    by its path, since "to_out" alone would also name the double blocks' ModuleList)."""
    single = range(transformer.config.num_single_layers)
    return ["to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj",
            *(f"single_transformer_blocks.{i}.attn.to_out" for i in single)]


# --- references -------------------------------------------------------------------------------------

def references_of(batch: dict) -> list[list[torch.Tensor]]:
    """Each sample's reference images ([3, H, W] pixels): none with the captions layout; an edit pair's
    control images (`control_values` [B, references, 3, H, W], or a sequence of them per sample)."""
    controls = batch.get("control_values")
    if controls is None:
        return [[] for _ in batch["captions"]]
    return [list(images) for images in controls]


def batch_references(batch: dict) -> list[torch.Tensor]:
    """The batch's references by position, each [B, 3, H, W]: every sample must have as many, of the
    same sizes, as the first (the transformer reads one sample's position ids for the batch)."""
    per_sample = references_of(batch)
    counts = {len(images) for images in per_sample}
    if len(counts) > 1:
        raise ConfigError(f"spec.training.batchSize: a FLUX.2 batch needs the same number of reference images per "
                          f"sample, this one has {sorted(counts)}: train with batchSize 1, or give each sample as many")
    try:
        return [torch.stack(images) for images in zip(*per_sample)]
    except RuntimeError:
        raise ConfigError("spec.data: the reference images of one FLUX.2 batch differ in size; every sample's "
                          "reference i must have the same size (keep spec.data.bucketing, which sizes them by "
                          "their target, or batchSize 1)") from None


# --- the part -------------------------------------------------------------------------------------

class Flux2Diffusion:
    """FLUX.2's transformer, trained, with its frozen VAE and a text part (`text`: a class taking
    (root, device, weight_dtype), e.g. flux2.MistralText) whose encoder gives [B, 512, 3 x hidden] prompt
    embeddings. frozen_models() are the family's ModelFamily.frozen_models, which the base places."""

    def __init__(self, spec, device: torch.device, weight_dtype: torch.dtype, text: type):
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        self.spec, self.device, self.weight_dtype = spec, device, weight_dtype
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        root = spec.model.pretrained
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        self.text = text(root, device, weight_dtype)
        self.vae = load_vae(spec, AutoencoderKLFlux2, weight_dtype)  # spec.model.vae's, else the model's own
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        self.latents_mean = bn.running_mean.detach().float().view(1, -1, 1, 1).to(device)
        self.latents_std = torch.sqrt(bn.running_var.detach().float() + eps).view(1, -1, 1, 1).to(device)
        self.transformer = load_denoiser(spec, Flux2Transformer2DModel, "transformer", weight_dtype)
        self.trainable = train_denoiser(self.transformer, spec, "transformer", self.text.pipeline, device,
                                        targets=lora_targets(self.transformer))
        self._ids: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # position_ids by batch geometry

    def frozen_models(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.text.text_encoder, "vae": self.vae}

    # --- encoders -----------------------------------------------------------------------------

    def encoders(self, owner: str) -> dict[str, Encoder]:
        """The VAE and the text encoder as cacheable encoders. The text identity holds what decides
        the embedding besides the weights (template, layers, length: the text part's `settings`) and
        `owner`, the family's name, so [dev] and [klein] never share entries."""
        root, dtype = self.spec.model.pretrained, self.weight_dtype
        text = model_identity(self.text.text_encoder, f"{root}/text_encoder", dtype, extra=self.text.settings())
        vae = model_identity(self.vae, vae_name(self.spec), self.vae.dtype)
        return {"latents": Encoder("latents", vae, self.vae_moments),
                "text": Encoder("text", text + owner, self.text.encode)}

    @torch.no_grad()
    def vae_moments(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean and log-variance of each latent, not a sample: the noise is drawn at training time."""
        stacked = to_device(torch.stack(pixels), self.vae.device, self.vae.dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    def encode_batch(self, family, batch: dict) -> dict[str, Any]:
        """Every cacheable encoding of a batch: the targets' latents, the captions' embeddings and each
        reference position's latents ("references", a list), each stored with its flipped form and
        the caption dropout did not draw (family: the ModelFamily, whose encode goes through the cache)."""
        encoded = family.encode_images_and_captions(batch)
        references = []
        for stack in batch_references(batch):
            images = list(stack)
            references.append(family.encode("latents", images, family.mirror_variants(images)))
        return {"target": encoded["latents"], "text": encoded["text"], "references": references}

    def normalised(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, H/8, W/8] VAE latents -> [B, 4C, H/16, W/16]: 2x2 patches into channels, then normalised
        by the VAE's batch-norm running statistics, as the pipelines encode references."""
        from diffusers import Flux2Pipeline

        patches = Flux2Pipeline._patchify_latents(latents)
        return (patches - self.latents_mean.to(patches.dtype)) / self.latents_std.to(patches.dtype)

    # --- loss ---------------------------------------------------------------------------------

    def loss(self, model: torch.nn.Module, encoded: dict, random: SampleRandom) -> torch.Tensor:
        """Flow matching: the transformer, at noise level sigma (its timestep, in [0, 1]), reads the noisy
        target's tokens then the references' (their mean latents, as the pipelines encode them) and
        predicts the velocity noise - target for the target's tokens."""
        from diffusers import Flux2Pipeline

        target = self.normalised(diffusion.sample_latents(encoded["target"]["moments"], random))
        noise, sigmas, noisy = flow_matching.noisy_latents(target, random)
        references = [self.normalised(entry["moments"].chunk(2, dim=1)[0]) for entry in encoded["references"]]
        pack = Flux2Pipeline._pack_latents
        tokens = pack(noisy)
        hidden = torch.cat([tokens, *(pack(reference) for reference in references)], dim=1)
        embeds = encoded["text"]["prompt_embeds"]
        txt_ids, img_ids = self.position_ids(target, references, embeds)
        prediction = model(
            hidden_states=hidden, timestep=sigmas.to(target.dtype), guidance=self.guidance(target.shape[0]),
            encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0][:, :tokens.shape[1]]
        return flow_matching.loss(prediction, pack(noise - target))

    def position_ids(self, target: torch.Tensor, references: list[torch.Tensor], embeds: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(text ids, image ids) on the device for the batch's geometry, made once per geometry (a bucket's
        shapes recur every step: no copy to the GPU each step)."""
        from diffusers import Flux2Pipeline

        key = (tuple(target.shape), tuple(tuple(r.shape) for r in references), tuple(embeds.shape))
        if key not in self._ids:
            self._ids[key] = (to_device(Flux2Pipeline._prepare_text_ids(embeds), self.device),
                              to_device(image_ids(target, references), self.device))
        return self._ids[key]

    def guidance(self, batch_size: int) -> torch.Tensor | None:
        """The text part's training guidance for a guidance-distilled transformer ([dev]); None otherwise."""
        if self.text.guidance is None or not self.transformer.config.guidance_embeds:
            return None
        return torch.full((batch_size,), self.text.guidance, device=self.device, dtype=torch.float32)

    # --- sampling -----------------------------------------------------------------------------

    def pipeline(self):
        """The text part's diffusers pipeline around these models (the transformer as it is being trained);
        its config (klein's is_distilled) from the model's model_index.json."""
        import diffusers

        return getattr(diffusers, self.text.pipeline).from_pretrained(
            self.spec.model.pretrained, scheduler=self.scheduler, vae=self.vae, transformer=self.transformer,
            text_encoder=self.text.text_encoder, tokenizer=self.text.tokenizer)

    @staticmethod
    def cases(held_out: list[dict], draw: Draw) -> list[tuple[str, list[torch.Tensor]]]:
        """(prompt, reference pixels) to draw: the draw's prompts (text to image), else, when it draws
        held-out samples, its first `count` held-out samples with their references (validation on edit
        pairs always does, Draw.for_validation)."""
        if draw.prompts:
            return [(prompt, []) for prompt in draw.prompts]
        if not draw.held_out:
            return []
        cases = [case for batch in held_out for case in zip(batch["captions"], references_of(batch))]
        return cases[:draw.count]

    @torch.no_grad()
    def sample_images(self, held_out: list[dict], draw: Draw) -> list:
        """One image per case, at the training size, with the case's references, guided by the draw's
        guidance as the text part allows."""
        cases = self.cases(held_out, draw)
        if not cases:
            return []
        pipeline = self.pipeline()
        pipeline.set_progress_bar_config(disable=True)
        width, height = self.spec.size
        guidance = self.text.sample_guidance(pipeline, draw.guidance)
        options = {"width": width, "height": height, "num_inference_steps": draw.steps,
                   "max_sequence_length": MAX_TEXT_TOKENS, "text_encoder_out_layers": self.text.layers,
                   "generator": draw.generator(), **({"guidance_scale": guidance} if guidance is not None else {})}
        return [pipeline(prompt=prompt, image=[reference_image(pixels) for pixels in references] or None,
                         **options).images[0]
                for prompt, references in cases]

    def clip_metrics(self, images: list, held_out: list[dict], draw: Draw, clip) -> dict[str, float]:
        """clip_score of the images drawn from cases(held_out, draw), against their prompts."""
        if not images:
            return {}
        return {"clip_score": clip.clip_score(images, [prompt for prompt, _ in self.cases(held_out, draw)])}


def image_ids(target: torch.Tensor, references: list[torch.Tensor]) -> torch.Tensor:
    """Position ids [B, N, 4] (t, h, w, l) of the target's tokens (t = 0) then each reference's (t = 10, 20...)."""
    from diffusers import Flux2Pipeline

    ids = [Flux2Pipeline._prepare_latent_ids(target)]
    if references:
        # diffusers numbers a list of one-sample latents; the batch shares them (see the module's docstring)
        shared = Flux2Pipeline._prepare_image_ids([reference[:1] for reference in references],
                                                  scale=REFERENCE_TIME_STEP)
        ids.append(shared.expand(target.shape[0], -1, -1))
    return torch.cat(ids, dim=1)


def reference_image(pixels: torch.Tensor):
    """A reference as the pipelines take it: a PIL image, enlarged to their minimum side where smaller
    (only tiny test resolutions are)."""
    from PIL import Image

    from kubetune_trainer.data.images import to_pil

    image = to_pil(pixels)
    scale = MIN_REFERENCE_SIDE / min(image.size)
    if scale > 1:
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
    return image


# --- declarations both families share: the architecture's image side, the tiny model, planning -----

def image_components(transformer: dict) -> dict[str, Component]:
    """The reference architecture's transformer (its published config) and VAE."""
    return {"transformer": Component("transformer", "diffusers", "Flux2Transformer2DModel", transformer),
            "vae": Component("vae", "diffusers", "AutoencoderKLFlux2", FLUX2_VAE)}


def tiny_image_models(text_width: int, guidance_embeds: bool, seed: int = 0) -> dict[str, torch.nn.Module]:
    """A 1+1-block Flux2Transformer2DModel reading three stacked text layers of `text_width`, and a
    4-level (8x) AutoencoderKLFlux2 with 4 latent channels and non-trivial batch-norm statistics (so
    the normalisation acts), plus FLUX.2's scheduler: a pipeline's image side, for its tiny model."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    latent_channels = 4
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * text_width, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=guidance_embeds,
    )
    vae = AutoencoderKLFlux2(block_out_channels=(16, 16, 16, 16), layers_per_block=1, latent_channels=latent_channels,
                             norm_num_groups=8, sample_size=32)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, 4 * latent_channels))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 4 * latent_channels))
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler()}


class Flux2Family(ModelFamily):
    """A FLUX.2 family: Flux2Diffusion composed with the family's text part, TEXT (flux2.MistralText,
    flux2_klein.Qwen3Text); the rest of the family is its module's declarations."""

    TEXT: type

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        self.flux = Flux2Diffusion(spec, device, weight_dtype, self.TEXT)
        self.trainable = self.flux.trainable

    def frozen_models(self):
        return self.flux.frozen_models()

    def build_encoders(self):
        # The family's name is part of every cached text entry's identity ([dev] and [klein] apart).
        return self.flux.encoders(self.spec.model.family)

    def encode_batch(self, batch):
        return self.flux.encode_batch(self, batch)

    def compute_loss(self, model, batch, random):
        return self.flux.loss(model, self.encode_batch(batch), random)

    def sample_images(self, model, held_out, draw):
        return self.flux.sample_images(held_out, draw)

    def image_metrics(self, images, held_out, draw, clip):
        return self.flux.clip_metrics(images, held_out, draw, clip)


def planning_forward(guidance: bool):
    """The planner's forward mirroring Flux2Diffusion.loss (guidance: the family trains with a guidance
    value): the target's tokens, plus one reference's with the edit-pairs layout (the usual edit pair;
    each further reference of the target's size adds as many tokens again), and 512 text tokens."""

    def forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
        transformer, vae = models["transformer"], models["vae"]
        batch, side = spec.training.batch_size, spec.resolution // vae_scale(vae) // 2
        tokens, width = side * side, transformer.config.in_channels     # 2x2 latent patches per token
        image_tokens = tokens * (2 if DATA_LAYOUTS[spec.data.layout].edits else 1)
        with autocast():
            prediction = transformer(
                hidden_states=make((batch, image_tokens, width), dtype), timestep=make((batch,), dtype),
                guidance=make((batch,), torch.float32) if guidance and transformer.config.guidance_embeds else None,
                encoder_hidden_states=make((batch, MAX_TEXT_TOKENS, transformer.config.joint_attention_dim), dtype),
                txt_ids=make((batch, MAX_TEXT_TOKENS, 4), torch.long),
                img_ids=make((batch, image_tokens, 4), torch.long), return_dict=False,
            )[0][:, :tokens]
        return mse(prediction, make((batch, tokens, width), dtype))

    return forward


def meta_trainable(spec, models) -> None:
    """What the families train, on the planner's meta models: the transformer, whole or a LoRA on lora_targets."""
    from kubetune_trainer.families.trainable import diffusers_denoiser

    transformer = models["transformer"]
    diffusers_denoiser(transformer, spec.adapter, "transformer", pipeline=None, load_init=False,
                       targets=lora_targets(transformer))
