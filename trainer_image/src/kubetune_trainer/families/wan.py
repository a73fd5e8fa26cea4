"""Wan 2.1 / 2.2 text-to-video: a LoRA (or full fine-tune) of the video transformer, by flow matching.

As in diffusers' WanPipeline:
- Text: UMT5-XXL's last hidden states of the caption (512 tokens at most), zeroed past its real
  length and zero-padded to 512 (the transformer attends to all 512, the zeros included).
- Latents: AutoencoderKLWan's, of clips [B, C, F, H, W] (F = 4k + 1 frames become k + 1 latent
  frames: the first alone, then 4 per latent), normalised per channel by the VAE's latents_mean and
  latents_std. Wan 2.2 TI2V-5B's VAE has 48 channels, 16x spatial compression (2x2 pixel patches
  inside the VAE) and the transformer takes one timestep per token (model_index expand_timesteps).
- The transformer predicts the flow velocity noise - x0 at timestep 1000 sigma; noise levels are
  drawn logit-normal and shifted by the model's own scheduler config's flow shift (`flow_shift`), as
  sd35 draws them; validation samples with that scheduler too. The published configs differ by model,
  not by version (diffusers' scripts/convert_wan_to_diffusers.py writes 3.0 for Wan 2.1 T2V/I2V and
  Wan 2.2 A14B T2V/I2V, 5.0 for Wan 2.2 TI2V-5B), so the folder says, never a table here.
- Wan 2.2 A14B has two experts: `transformer` denoises the high noise levels (1000 sigma at or above
  boundary_ratio x 1000), `transformer_2` the low ones. spec.model.experts picks which train: one
  expert trains on its own range of noise levels only (the draw is mapped into it), "both" (the
  default for such a model) routes each sample to the expert of its noise level.

Image-to-video (a folder whose model_index.json names WanImageToVideoPipeline: Wan 2.1 I2V 14B,
Wan 2.2 I2V A14B): the first frame is the condition, as WanImageToVideoPipeline prepares it: the
clip with every frame after the first zeroed, encoded by the VAE (its mode), normalised, behind a
4-channel mask marking the first frame's latent (4 frames wide, the VAE's temporal factor); the
transformer takes [noisy latents, mask, condition] on its channels (36). Wan 2.1 I2V also reads the
first frame's CLIP ViT-H penultimate states (its image_encoder) through added key/value projections,
which its LoRA adapts too. A 1-frame clip is its own condition: the model learns to keep the frame,
which is what a 1-frame I2V sample asks; the first-frame conditioning of longer clips is the same code.
TI2V-5B's image-to-video (its folder as a WanImageToVideoPipeline with expand_timesteps) conditions
through the latents instead: the first frame alone, encoded by the VAE (its mode) and normalised,
replaces the first latent frame of the noisy clip, whose tokens get timestep 0; the transformer takes
its 48 channels only, and the loss is the later latent frames' (the pipeline overwrites the first's
prediction with the condition). It trains on clips of at least 5 frames (a 1-latent-frame sample is
all condition), refused otherwise naming spec.data.frames.

Training data: the `video-captions` layout's clips, or the `captions` layout's images, each a 1-frame
clip (one latent frame, as Wan itself trains on images). A video batch ([B, F, C, H, W] pixel_values,
frames in [-1, 1]) and an image batch take the same path: clips() is the one place a batch becomes the
VAE's [B, C, F, H, W]. Validation renders clips of the shortest spec.data.frames (sample_clips.Clip;
the validator writes them as .mp4 and GIF), or images when the data are images.

Files: the LoRA of `transformer` is pytorch_lora_weights.safetensors, the one WanPipeline's
load_lora_weights(folder) reads; the low-noise expert's is LOW_NOISE_FILE, which diffusers loads with
load_lora_weights(folder, weight_name=LOW_NOISE_FILE, load_into_transformer_2=True) (its keys are
`transformer.…` too: diffusers' Wan loader names both experts' LoRAs so). Each file's metadata says
its expert (METADATA_KEY). A full fine-tune writes each trained expert's folder (transformer/,
transformer_2/).
"""
from __future__ import annotations

import json
import logging
from functools import cached_property
from pathlib import Path

import torch

from kubetune_api.spec_data import frame_counts
from kubetune_trainer.training import diffusion, flow_matching, quantization
from kubetune_trainer.models import tiny_models
from kubetune_trainer.data.cache import Encoder, model_identity
from kubetune_trainer.training.device_copy import to_device
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.denoiser import load_denoiser
from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS, LORA_FILE, load_lora_init, lora_layers
from kubetune_trainer.families.trainable import Trainable, diffusers_denoiser, enable_gradient_checkpointing
from kubetune_trainer.families.vae import load_vae, vae_name
from kubetune_trainer.results.lora_keys import WAN_ORIGINAL
from kubetune_trainer.families.planning_forwards import mse
from kubetune_trainer.families.components import Component
from kubetune_trainer.results.sample_clips import DEFAULT_FPS, Clip

log = logging.getLogger("kubetune.trainer")

PIPELINE = "WanPipeline"
I2V_PIPELINE = "WanImageToVideoPipeline"  # model_index.json's _class_name of an image-to-video folder
MAX_TEXT_TOKENS = 512  # WanPipeline's max_sequence_length (Wan's text_len): longer captions are truncated
LOW_NOISE_FILE = "pytorch_lora_weights_transformer_2.safetensors"
METADATA_KEY = "kubetune.expert"  # in each LoRA file: high-noise, low-noise, or whole (a one-expert model)
# spec.model.experts -> the pipeline components that train.
EXPERTS = {"high-noise": ("transformer",), "low-noise": ("transformer_2",), "both": ("transformer", "transformer_2")}
EXPERT_OF = {"transformer": "high-noise", "transformer_2": "low-noise"}
TIMESTEPS = 1000  # the schedulers' num_train_timesteps: the transformer's timestep is 1000 sigma


# --- what the model folder says ----------------------------------------------------------------

def boundary(index: dict) -> float | None:
    """The two experts' boundary noise level (model_index.json's boundary_ratio), or None for a
    one-expert model (Wan 2.1, Wan 2.2 TI2V-5B): WanPipeline uses transformer_2 only with both."""
    second = index.get("transformer_2") or [None, None]
    return index.get("boundary_ratio") if second[0] is not None else None


def trained_experts(spec, index: dict) -> tuple[str, ...]:
    """The components spec.model.experts trains; a one-line refusal where the model has one expert."""
    chosen = spec.model.experts
    if boundary(index) is None:
        if chosen is not None:
            raise ConfigError(f"spec.model.experts: {chosen!r} needs a two-expert model (Wan 2.2 A14B), but "
                              f"{spec.model.pretrained}/model_index.json names no transformer_2 with a boundary_ratio; "
                              "remove spec.model.experts")
        return ("transformer",)
    return EXPERTS[chosen or "both"]


def sigma_range(experts: tuple[str, ...], split: float | None) -> tuple[float, float]:
    """The noise levels the trained experts denoise: a lone expert of a two-expert model its own side
    of the boundary (as WanPipeline hands them: 1000 sigma >= 1000 boundary goes to `transformer`)."""
    if split is None or len(experts) == 2:
        return 0.0, 1.0
    return (split, 1.0) if experts == ("transformer",) else (0.0, split)


def check_resolution(spec, vae_config: dict, transformer_config: dict) -> None:
    """Refuse a size whose latents the transformer cannot cut into whole patches (the row's 16 is the
    8x VAE's; the 5B's 16x VAE needs 32): WanPipeline would round such a size down."""
    scale, patch = vae_config.get("scale_factor_spatial") or 8, transformer_config["patch_size"][1]
    factor = scale * patch
    for side in spec.size:
        if side % factor:
            lower = side // factor * factor
            raise ConfigError(f"spec.data.resolution: {side} is not a multiple of {factor}, which this wan model "
                              f"needs (its VAE's {scale}x times its {patch}x{patch} patches); use {lower} or "
                              f"{lower + factor}")


def check_latent_condition_frames(spec, vae_config) -> None:
    """TI2V-5B image-to-video learns the latent frames after the first (the condition): refuse samples
    with none, images or clips of fewer frames than one latent frame past the first."""
    temporal = vae_config.get("scale_factor_temporal", 4)
    shortest = min(frame_counts(getattr(spec.data, "frames", None)) or [1])
    if shortest < temporal + 1:
        given = f"spec.data.frames {shortest}" if getattr(spec.data, "frames", None) else "images (1 frame each)"
        raise ConfigError(f"spec.data.frames: TI2V-5B image-to-video trains the frames after the first (the first "
                          f"is its condition), but {given} leave none; train on clips (layout video-captions) of "
                          f"at least {temporal + 1} frames, or use its WanPipeline folder (text-to-video)")


def first_frame_condition(clip: torch.Tensor) -> torch.Tensor:
    """What the VAE encodes as an image-to-video condition: the clip [B, C, F, H, W] with every frame
    after the first zeroed (WanImageToVideoPipeline's video_condition without a last image)."""
    condition = torch.zeros_like(clip)
    condition[:, :, 0] = clip[:, :, 0]
    return condition


def first_frame_mask(batch: int, frames: int, height: int, width: int, temporal: int = 4) -> torch.Tensor:
    """The condition's mask [B, temporal, latent frames, h, w]: 1 on the first frame, which the VAE
    gives a latent of its own, so it fills the first latent's `temporal` mask channels."""
    mask = torch.zeros(batch, 1, frames + temporal - 1, height, width)
    mask[:, :, :temporal] = 1
    return mask.view(batch, -1, temporal, height, width).transpose(1, 2)


def first_latent_mask(latents: torch.Tensor) -> torch.Tensor:
    """TI2V-5B's first-frame mask [1, 1, F, h, w] for latents [B, C, F, h, w]: 0 on the first latent
    frame (the condition), 1 elsewhere (WanImageToVideoPipeline.prepare_latents with expand_timesteps)."""
    mask = torch.ones(1, 1, *latents.shape[2:], dtype=latents.dtype, device=latents.device)
    mask[:, :, 0] = 0
    return mask


def normalised(latents: torch.Tensor, vae_config) -> torch.Tensor:
    """VAE latents [B, C, F, h, w] as the transformer sees them, per channel (the pipelines' decode
    undoes exactly this; WanImageToVideoPipeline normalises its condition so too)."""
    shape = (1, vae_config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae_config.latents_mean).view(shape).to(latents)
    std = torch.tensor(vae_config.latents_std).view(shape).to(latents)
    return (latents - mean) / std


def clips(pixels: torch.Tensor) -> torch.Tensor:
    """A batch as the VAE takes it, [B, C, F, H, W]: images [B, C, H, W] are 1-frame clips; a video
    layout's clips come as [B, F, C, H, W] and must have 4k + 1 frames (the VAE's temporal grid)."""
    if pixels.dim() == 4:
        return pixels.unsqueeze(2)
    frames = pixels.shape[1]
    if (frames - 1) % 4:
        raise ConfigError(f"spec.data: clips of {frames} frames; wan takes 4k + 1 frames (1, 5, ..., 81)")
    return pixels.transpose(1, 2)


# --- the trained module ---------------------------------------------------------------------

class Experts(torch.nn.Module):
    """The trained expert(s) as one module (what DDP wraps and FSDP shards), each running on the
    samples routed to it. An expert no sample of the micro-batch goes to still runs on one sample,
    its output times zero joining the loss: every process then runs the same modules in the same
    order (FSDP's all-gathers) and every trained weight gets a gradient (DDP's reducer)."""

    def __init__(self, experts: dict[str, torch.nn.Module]):
        super().__init__()
        for name, module in experts.items():
            self.add_module(name, module)
        self.names = tuple(experts)

    def forward(self, routes: dict[str, torch.Tensor], hidden_states, timestep, encoder_hidden_states,
                image_embeds: torch.Tensor | None = None):
        if len(self.names) == 1:
            return getattr(self, self.names[0])(hidden_states, timestep, encoder_hidden_states, image_embeds,
                                                return_dict=False)[0]
        output, unused = None, 0.0
        for name in self.names:
            chosen = routes[name]
            rows = chosen if chosen.any() else torch.arange(len(chosen), device=chosen.device) == 0
            out = getattr(self, name)(hidden_states[rows], timestep[rows], encoder_hidden_states[rows],
                                      None if image_embeds is None else image_embeds[rows], return_dict=False)[0]
            if not chosen.any():
                unused = unused + out.sum() * 0.0
                continue
            if output is None:
                output = out.new_zeros((len(chosen), *out.shape[1:]))
            output = output.index_put((chosen,), out)
        return output + unused


def _with_expert_metadata(file: Path, expert: str) -> None:
    """Add which expert a LoRA file adapts to its safetensors metadata (beside diffusers' own keys)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(file), "pt") as opened:
        metadata = dict(opened.metadata() or {})
    save_file(load_file(file), file, metadata={**metadata, METADATA_KEY: expert})


class Wan(ModelFamily):
    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything
        import diffusers
        from diffusers import AutoencoderKLWan, DiffusionPipeline, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        root = spec.model.pretrained
        self.index = DiffusionPipeline.load_config(root)
        self.image_to_video = self.index.get("_class_name") == I2V_PIPELINE
        # TI2V-5B as an image-to-video pipeline: the condition is the first latent frame itself.
        self.condition_in_latents = self.image_to_video and bool(self.index.get("expand_timesteps"))
        if self.condition_in_latents:
            check_latent_condition_frames(spec, AutoencoderKLWan.load_config(root, subfolder="vae"))
        self.boundary = boundary(self.index)
        self.expert_names = trained_experts(spec, self.index)
        check_resolution(spec, AutoencoderKLWan.load_config(root, subfolder="vae"),
                         WanTransformer3DModel.load_config(root, subfolder=self.expert_names[0]))
        self.sigmas = sigma_range(self.expert_names, self.boundary)
        self.scheduler = getattr(diffusers, self.index["scheduler"][1]).from_pretrained(root, subfolder="scheduler")
        self.tokenizer = AutoTokenizer.from_pretrained(root, subfolder="tokenizer")
        self.text_encoder = UMT5EncoderModel.from_pretrained(root, subfolder="text_encoder", torch_dtype=weight_dtype)
        self.vae = load_vae(spec, AutoencoderKLWan, weight_dtype)
        self.image_encoder, self.image_processor = self._load_image_encoder()
        self.experts = {name: load_denoiser(spec, WanTransformer3DModel, name, weight_dtype)
                        for name in self.expert_names}
        # Wan 2.1 I2V's image cross-attention (added key/value projections) adapts with the rest: a LoRA
        # without them would load into WanImageToVideoPipeline padded with zeros for them.
        targets = DIFFUSERS_ATTENTION_TARGETS + (["add_k_proj", "add_v_proj"] if self.image_encoder is not None else [])
        self._per_expert = {name: diffusers_denoiser(module, spec.adapter, name, PIPELINE, load_init=False,
                                                     targets=targets)
                            for name, module in self.experts.items()}
        if spec.adapter.init_from:
            for name, module in self.experts.items():
                load_lora_init(module, self._init_file(spec.adapter.init_from, name), "transformer")
        module = Experts(self.experts).to(device).train()
        self.trainable = Trainable(module, self._write, publishable=spec.adapter.type == "lora", read=self._read)
        log.info("wan: training %s (%s) on noise levels %.3f-%.3f%s, %s", self.expert_label,
                 ", ".join(self.expert_names), *self.sigmas,
                 f", boundary {self.boundary}" if self.boundary is not None else "",
                 "image-to-video (first frame as condition)" if self.image_to_video else "text-to-video")

    def _load_image_encoder(self):
        """Wan 2.1 I2V's CLIP vision tower and its processor (None, None where the folder has none)."""
        if (self.index.get("image_encoder") or [None])[0] is None:
            return None, None
        from transformers import CLIPImageProcessor, CLIPVisionModel

        root = self.spec.model.pretrained
        return (CLIPVisionModel.from_pretrained(root, subfolder="image_encoder", torch_dtype=self.weight_dtype),
                CLIPImageProcessor.from_pretrained(root, subfolder="image_processor"))

    @property
    def expert_label(self) -> str:
        """What the log and the LoRA metadata call what trains."""
        if self.boundary is None:
            return "whole"  # a one-expert model
        return "both" if len(self.expert_names) == 2 else EXPERT_OF[self.expert_names[0]]

    @staticmethod
    def _init_file(source: str, name: str) -> str:
        """spec.adapter.initFrom for one expert: a folder holds each expert's file; a file is the one
        trained expert's."""
        path = Path(source)
        return str(path / (LOW_NOISE_FILE if name == "transformer_2" else LORA_FILE)) if path.is_dir() else source

    def frozen_models(self):
        image = {"image_encoder": self.image_encoder} if self.image_encoder is not None else {}
        return {"text_encoder": self.text_encoder, "vae": self.vae, **image}

    def enable_gradient_checkpointing(self):
        for module in self.experts.values():
            enable_gradient_checkpointing(module)

    # --- encoders -----------------------------------------------------------------------------

    def build_encoders(self):
        root, dtype = self.spec.model.pretrained, self.weight_dtype
        vae = model_identity(self.vae, vae_name(self.spec), self.vae.dtype)
        text = model_identity(self.text_encoder, f"{root}/text_encoder", dtype, extra=json.dumps([MAX_TEXT_TOKENS]))
        encoders = {"latents": Encoder("latents", vae, self._vae_moments),
                    "text": Encoder("text", text + "wan", self.encode_prompts)}
        if self.condition_in_latents:
            encoders["condition"] = Encoder("condition", vae + "first frame alone", self._first_frame_latents)
        elif self.image_to_video:
            encoders["condition"] = Encoder("condition", vae + "first-frame condition", self._condition_latents)
        if self.image_encoder is not None:
            image = model_identity(self.image_encoder, f"{root}/image_encoder", dtype, extra="hidden_states[-2]")
            encoders["image"] = Encoder("image", image, self._image_embeds)
        return encoders

    @cached_property
    def _prompt_pipeline(self):
        """A pipeline without transformers, for its own prompt encoding (cleaning, UMT5, zeroed padding)."""
        from diffusers import WanPipeline

        return WanPipeline(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae,
                           scheduler=self.scheduler)

    @torch.no_grad()
    def _vae_moments(self, pixels):
        stacked = to_device(clips(torch.stack(pixels)), self.vae.device, self.vae.dtype)
        return {"moments": self.vae.encode(stacked).latent_dist.parameters}

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The pipeline's prompt embeddings cut after the batch's longest caption (what follows is zeros,
        which compute_loss puts back: the cache then stores no 512-token rows of zeros)."""
        embeds, _ = self._prompt_pipeline.encode_prompt(
            list(captions), do_classifier_free_guidance=False, max_sequence_length=MAX_TEXT_TOKENS,
            device=self.text_encoder.device)
        used = (embeds != 0).any(-1).any(0).nonzero()
        return {"prompt_embeds": embeds[:, :int(used.max()) + 1 if len(used) else 1]}

    @torch.no_grad()
    def _condition_latents(self, pixels):
        """The first-frame condition's latents: the VAE's mode, as the pipeline takes them (argmax)."""
        condition = first_frame_condition(to_device(clips(torch.stack(pixels)), self.vae.device, self.vae.dtype))
        return {"latents": self.vae.encode(condition).latent_dist.mode()}

    @torch.no_grad()
    def _first_frame_latents(self, pixels):
        """TI2V-5B's condition: the first frame alone through the VAE, its mode (the pipeline's
        prepare_latents with expand_timesteps)."""
        first = to_device(clips(torch.stack(pixels))[:, :, :1], self.vae.device, self.vae.dtype)
        return {"latents": self.vae.encode(first).latent_dist.mode()}

    @torch.no_grad()
    def _image_embeds(self, pixels):
        """The first frame through the pipeline's CLIP processor (from [-1, 1]: no rescaling of 0-255
        values) and vision tower, its penultimate hidden states (WanImageToVideoPipeline.encode_image)."""
        frames = [(clips(pixel[None])[0, :, 0].float() + 1) / 2 for pixel in pixels]
        values = self.image_processor(images=frames, return_tensors="pt", do_rescale=False)["pixel_values"]
        values = to_device(values, self.image_encoder.device, self.image_encoder.dtype)
        return {"image_embeds": self.image_encoder(pixel_values=values, output_hidden_states=True).hidden_states[-2]}

    def encode_batch(self, batch):
        encoded = self.encode_images_and_captions(batch)
        pixels = list(batch["pixel_values"])
        for name in ("condition", "image"):
            if name in self.encoders():
                encoded[name] = self.encode(name, pixels, self.mirror_variants(pixels))
        return encoded

    def _normalised(self, latents: torch.Tensor) -> torch.Tensor:
        return normalised(latents, self.vae.config)

    # --- loss ---------------------------------------------------------------------------------

    def draw_sigmas(self, random) -> torch.Tensor:
        """Each sample's noise level: logit-normal, shifted by the scheduler's flow shift, then mapped
        into the trained experts' range (a lone expert trains on its own noise levels only)."""
        low, high = self.sigmas
        return low + (high - low) * flow_matching.shifted(flow_matching.sample_sigmas(random),
                                                          flow_shift(self.scheduler.config))

    def routes(self, sigmas: torch.Tensor) -> dict[str, torch.Tensor]:
        """Which trained expert denoises each sample: WanPipeline's rule, 1000 sigma >= 1000 boundary -> transformer."""
        if self.boundary is None or len(self.expert_names) == 1:
            return {name: torch.ones_like(sigmas, dtype=torch.bool) for name in self.expert_names}
        high = sigmas >= self.boundary
        return {"transformer": high, "transformer_2": ~high}

    def compute_loss(self, model, batch, random):
        encoded = self.encode_batch(batch)
        latents = self._normalised(diffusion.sample_latents(encoded["latents"]["moments"], random))
        noise = random.normal(latents.shape[1:], latents.device, latents.dtype)
        sigmas = to_device(self.draw_sigmas(random), latents.device)
        expanded = sigmas.view(-1, 1, 1, 1, 1).to(latents.dtype)
        noisy = (1 - expanded) * latents + expanded * noise
        text = encoded["text"]["prompt_embeds"]
        text = torch.nn.functional.pad(text, (0, 0, 0, MAX_TEXT_TOKENS - text.shape[1]))
        hidden = noisy
        # TI2V-5B image-to-video: the clean first frame in place of the noisy one, timestep 0 on its tokens.
        kept = first_latent_mask(noisy) if self.condition_in_latents else None
        if kept is not None:
            condition = self._normalised(encoded["condition"]["latents"]).to(noisy)
            hidden = (1 - kept) * condition + kept * noisy
        elif self.image_to_video:  # [noisy latents, first-frame mask, condition latents] on the channels
            batch_size, _, frames, height, width = noisy.shape
            mask = first_frame_mask(batch_size, clips(batch["pixel_values"]).shape[2], height, width,
                                    self.vae.config.scale_factor_temporal).to(noisy)
            hidden = torch.cat([noisy, mask, self._normalised(encoded["condition"]["latents"]).to(noisy)], dim=1)
        image_embeds = encoded["image"]["image_embeds"].to(self.weight_dtype) if "image" in encoded else None
        timestep = sigmas * TIMESTEPS
        if self.index.get("expand_timesteps"):  # TI2V-5B: one timestep per token (all equal without a condition frame)
            _, patch_h, patch_w = self.experts[self.expert_names[0]].config.patch_size
            frames, height, width = noisy.shape[2:]
            timestep = timestep[:, None].expand(-1, frames * (height // patch_h) * (width // patch_w))
            if kept is not None:  # the pipeline's per-token timesteps: the mask at token resolution times t
                timestep = timestep * kept[0, 0][:, ::patch_h, ::patch_w].flatten()[None]
        prediction = model(self.routes(sigmas), hidden.to(self.weight_dtype), timestep,
                           text.to(self.weight_dtype), image_embeds)
        if kept is not None:  # the first latent frame is the condition: nothing to learn there
            return flow_matching.loss(prediction[:, :, 1:], (noise - latents)[:, :, 1:])
        return flow_matching.loss(prediction, noise - latents)

    # --- output -------------------------------------------------------------------------------

    def _write(self, out_dir: Path, trained: dict[str, torch.Tensor]) -> list[Path]:
        """Each trained expert's weights: its LoRA file (metadata naming the expert), or its model folder."""
        files = []
        for name, module in self.experts.items():
            own = {key.removeprefix(f"{name}."): value for key, value in trained.items() if key.startswith(f"{name}.")}
            if self.spec.adapter.type == "full":
                files += self._per_expert[name].write(out_dir, own)
                continue
            from diffusers import WanPipeline

            file = LOW_NOISE_FILE if name == "transformer_2" else LORA_FILE
            WanPipeline.save_lora_weights(out_dir, transformer_lora_layers=lora_layers(module, own),
                                          transformer_lora_adapter_metadata=module.peft_config["default"].to_dict(),
                                          weight_name=file, safe_serialization=True)
            _with_expert_metadata(out_dir / file, EXPERT_OF[name] if self.boundary is not None else "whole")
            files.append(out_dir / file)
        return files

    def _read(self, folder: Path) -> None:
        """What _write wrote in `folder`, into each trained expert."""
        for name, module in self.experts.items():
            if self.spec.adapter.type == "full":
                self._per_expert[name].load(folder)
            else:
                load_lora_init(module, self._init_file(str(folder), name), "transformer")

    @cached_property
    def _untrained_experts(self) -> dict[str, torch.nn.Module]:
        """The two-expert model's other expert, frozen, loaded the first time samples are drawn (the
        pipeline denoises its noise levels with it); kept on the CPU between validations."""
        from diffusers import WanTransformer3DModel

        others = [name for name in ("transformer", "transformer_2") if name not in self.experts]
        return {name: WanTransformer3DModel.from_pretrained(self.spec.model.pretrained, subfolder=name,
                                                            torch_dtype=self.weight_dtype).requires_grad_(False).eval()
                for name in (others if self.boundary is not None else [])}

    def pipeline(self, experts: dict[str, torch.nn.Module]):
        import diffusers

        image = ({"image_encoder": self.image_encoder, "image_processor": self.image_processor}
                 if self.image_to_video else {})
        return getattr(diffusers, I2V_PIPELINE if self.image_to_video else PIPELINE)(
            tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae, scheduler=self.scheduler,
            transformer=experts.get("transformer"), transformer_2=experts.get("transformer_2"),
            boundary_ratio=self.boundary, expand_timesteps=bool(self.index.get("expand_timesteps")), **image)

    def condition_images(self, held_out: list[dict], count: int) -> list:
        """Image-to-video: the first frames of the first `count` held-out samples, as PIL images."""
        from torchvision.transforms.functional import to_pil_image

        frames = [clips(pixels[None])[0, :, 0] for batch in held_out for pixels in batch["pixel_values"]]
        return [to_pil_image((frame.float().clamp(-1, 1) + 1) / 2) for frame in frames[:count]]

    def _prompt_embeds(self, prompt: str, guidance: float | None) -> dict[str, torch.Tensor | None]:
        """A prompt (and the empty negative one under guidance) encoded as training encodes it: diffusers
        0.42.1's WanImageToVideoPipeline cleans prompts with ftfy unguarded (a NameError without it),
        WanPipeline only where ftfy is installed."""
        guided = (guidance or 0) > 1
        embeds, negative = self._prompt_pipeline.encode_prompt(
            [prompt], negative_prompt="" if guided else None, do_classifier_free_guidance=guided,
            max_sequence_length=MAX_TEXT_TOKENS, device=self.device)
        return {"prompt_embeds": embeds, "negative_prompt_embeds": negative}

    @property
    def sample_frames(self) -> int:
        """Frames of a validation clip: the fewest spec.data.frames the clips train at (one: an image
        layout's validation draws images)."""
        return min(frame_counts(self.spec.data.frames), default=1)

    @torch.no_grad()
    def sample_images(self, model, held_out, draw):
        """Clips of the draw's captions (sample_clips.Clip, sample_frames long, at spec.data.fps), or
        images where the data are images; image-to-video: each from a held-out sample's first frame
        (none without held-out samples)."""
        prompts = draw.captions(held_out)
        if self.image_to_video:
            conditions = self.condition_images(held_out, len(prompts))
            prompts = prompts[:len(conditions)]
        if not prompts:
            return []
        others = self._untrained_experts
        for module in others.values():
            module.to(self.device)
        try:
            pipeline = self.pipeline({**self.experts, **others})
            pipeline.set_progress_bar_config(disable=True)
            width, height = self.spec.size
            options = dict(height=height, width=width, num_frames=self.sample_frames,
                           num_inference_steps=draw.steps,
                           guidance_scale=draw.guidance, generator=draw.generator(),
                           max_sequence_length=MAX_TEXT_TOKENS, output_type="pil")
            if self.image_to_video:  # the pipeline takes one condition image per call
                videos = [pipeline(image=image, **self._prompt_embeds(prompt, draw.guidance), **options).frames[0]
                          for image, prompt in zip(conditions, prompts)]
            else:
                videos = pipeline(prompts, **options).frames
        finally:
            for module in others.values():
                module.to("cpu")
        if self.sample_frames == 1:
            return [video[0] for video in videos]
        return [Clip(list(video), self.spec.data.fps or DEFAULT_FPS) for video in videos]

    def image_metrics(self, images, held_out, draw, clip):
        """CLIP scores of the images, or of each clip's middle frame."""
        images = [sample.frames[len(sample.frames) // 2] if isinstance(sample, Clip) else sample for sample in images]
        return {"clip_score": clip.clip_score(images, draw.captions(held_out))} if images else {}


# --- declarations: reference architecture, folders, tiny model, planning ---------------------------

# Wan2.1-T2V-14B's transformer, which is also each expert of Wan2.2-T2V-A14B (high and low noise):
# 40 blocks of width 5120 (40 heads x 128), FFN 13824, UMT5 text (4096) projected in; 14.3B parameters.
WAN_14B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
# Wan2.2-TI2V-5B's dense transformer: 30 blocks of width 3072 (24 heads x 128), FFN 14336, on the
# 48-channel latents of its own VAE; one timestep per token (expand_timesteps); 5.0B parameters.
WAN_5B_TRANSFORMER = dict(
    WAN_14B_TRANSFORMER, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30,
)
# Wan 2.1's causal 3D VAE (Wan2.2 A14B's too): 16 channels, 8x spatial, 4x temporal, per-channel statistics.
WAN21_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                  0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
    scale_factor_temporal=4, scale_factor_spatial=8,
)
# Wan2.2-TI2V-5B's VAE: 48 channels, 2x2 pixel patches in, residual up/down blocks: 16x spatial, 4x temporal.
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
                  -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
                  -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                  -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
                  -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
                  0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
                 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
                 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
                 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
)
# google/umt5-xxl's encoder, every Wan model's text encoder: 24 layers of width 4096, 256k vocabulary; 5.7B.
UMT5_XXL_ENCODER = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)
BOUNDARY_T2V_A14B = 0.875  # Wan2.2-T2V-A14B: the high-noise expert takes 1000 sigma >= 875
# The reference: Wan2.1-T2V-14B, i.e. one Wan2.2-T2V-A14B expert as spec.model.experts high-noise or
# low-noise trains it (`both` holds two of these: the planner adds a folder's transformer_2, meta_trainable).
ARCHITECTURE = {
    "transformer": Component("transformer", "diffusers", "WanTransformer3DModel", WAN_14B_TRANSFORMER),
    "text_encoder": Component("text_encoder", "transformers", "UMT5EncoderModel", UMT5_XXL_ENCODER),
    "vae": Component("vae", "diffusers", "AutoencoderKLWan", WAN21_VAE),
}
MODEL_INDEX = {"transformer_2": [None, None], "boundary_ratio": None, "expand_timesteps": False}


# The flow shifts of the published diffusers folders' scheduler configs (diffusers'
# scripts/convert_wan_to_diffusers.py): what the tiny writer gives each layout; the trainer reads the folder's.
FLOW_SHIFT = 3.0             # Wan 2.1 T2V / I2V, Wan 2.2 T2V-A14B / I2V-A14B
FLOW_SHIFT_TI2V_5B = 5.0     # Wan 2.2 TI2V-5B


def flow_shift(config) -> float:
    """The shift a scheduler config applies to its noise levels: UniPC's `flow_shift` (WanPipeline's
    scheduler), or FlowMatchEulerDiscreteScheduler's `shift` where a folder swapped it in; 1: none."""
    return float(config.get("flow_shift") or config.get("shift") or 1.0)


def scheduler(flow_shift: float = FLOW_SHIFT):
    """WanPipeline's scheduler: UniPC over flow sigmas, shifted by `flow_shift`."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=TIMESTEPS, flow_shift=flow_shift)


def write_tokenizers(out_dir: Path) -> None:
    """A T5-style tokenizer stand-in for umt5-xxl's (hub vocabularies cannot be fetched)."""
    tiny_models.tiny_t5_tokenizer(max_length=MAX_TEXT_TOKENS).save_pretrained(out_dir / "tokenizer")


TINY_VARIANTS = ("a14b", "2.1", "ti2v-5b", "i2v-a14b", "i2v-2.1", "i2v-ti2v-5b")
BOUNDARY_I2V_A14B = 0.9  # Wan2.2-I2V-A14B's boundary_ratio


def write_tiny_wan(out_dir: Path, seed: int = 0, variant: str = "a14b") -> Path:
    """A Wan pipeline folder with 1-block transformers of width 24 (2 heads x 12), a 1-layer UMT5 of width 16
    and a 4-level causal VAE of width 8 (8x spatial, 4x temporal). variant: "a14b", Wan 2.2 T2V A14B's
    layout (two experts split at 0.875); "2.1", one expert; "ti2v-5b", one expert on a 48-channel VAE
    with 2x2 pixel patches (16x) and a timestep per token; "i2v-a14b", Wan 2.2 I2V A14B's
    WanImageToVideoPipeline (36 input channels, two experts split at 0.9); "i2v-2.1", Wan 2.1 I2V's
    (one expert reading a CLIP vision tower's states through added key/value projections); "i2v-ti2v-5b",
    TI2V-5B as a WanImageToVideoPipeline (the condition in the latents: 48 input channels)."""
    import diffusers
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    if variant not in TINY_VARIANTS:
        raise ValueError(f"wan tiny variant {variant!r}: use one of {', '.join(TINY_VARIANTS)}")
    tokenizer = tiny_models.tiny_t5_tokenizer(max_length=MAX_TEXT_TOKENS)
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1))
    dense, i2v, clip = variant.endswith("ti2v-5b"), variant.startswith("i2v"), variant == "i2v-2.1"
    extra_channels = i2v and not dense  # the 36-channel I2V models; TI2V-5B's condition is a latent frame
    channels = 48 if dense else 16
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        **(dict(decoder_base_dim=8, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                scale_factor_spatial=16, latents_mean=WAN22_VAE["latents_mean"], latents_std=WAN22_VAE["latents_std"])
           if dense else {}))

    def transformer():  # image-to-video: noisy latents + 4 mask channels + condition latents in
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=2 * channels + 4 if extra_channels else channels, out_channels=channels,
                                     text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
                                     **(dict(image_dim=16, added_kv_proj_dim=24) if clip else {}))

    two = variant in ("a14b", "i2v-a14b")
    split = (BOUNDARY_I2V_A14B if i2v else BOUNDARY_T2V_A14B) if two else None
    image = {}
    if clip:  # a 32 px ViT with 8 px patches: 17 tokens of width 16
        image = dict(image_encoder=CLIPVisionModel(CLIPVisionConfig(
                         hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         image_size=32, patch_size=8)),
                     image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                        crop_size={"height": 32, "width": 32}))
    elif i2v:
        image = dict(image_encoder=None, image_processor=None)
    pipeline = getattr(diffusers, I2V_PIPELINE if i2v else PIPELINE)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
        scheduler=scheduler(FLOW_SHIFT_TI2V_5B if dense else FLOW_SHIFT), transformer=transformer(),
        transformer_2=transformer() if two else None, boundary_ratio=split, expand_timesteps=dense, **image)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def meta_trainable(spec, models) -> None:
    """The planner's trained module as the family builds it: the expert spec.model.experts trains (both
    of a two-expert folder: the second built from its transformer_2/config.json, in one Experts module)."""
    from diffusers import WanTransformer3DModel

    folder = Path(spec.model.pretrained)
    index = json.loads((folder / "model_index.json").read_text()) if (folder / "model_index.json").is_file() else {}
    experts = trained_experts(spec, index)  # a choice the folder cannot take is refused here too
    first = models["transformer"]
    if len(experts) == 2:
        second = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder, subfolder="transformer_2"))
        models["transformer"] = Experts({"transformer": first, "transformer_2": second.to(first.dtype).eval()})
    for name, module in expert_modules(models).items():
        diffusers_denoiser(module.requires_grad_(False), spec.adapter, name, pipeline=None, load_init=False)


def expert_modules(models) -> dict[str, torch.nn.Module]:
    """The planner's expert(s), by component name."""
    trained = models["transformer"]
    return {name: getattr(trained, name) for name in trained.names} if isinstance(trained, Experts) else {
        "transformer": trained}


def planning_checkpointing(models) -> None:
    for module in expert_modules(models).values():
        enable_gradient_checkpointing(module)


def planning_forward(models, spec, make, autocast, dtype: torch.dtype) -> torch.Tensor:
    """compute_loss's transformer call: latents [B, C, F, h, w] and the 512 text tokens, through each
    trained expert (both experts on the whole batch: an upper bound of the routed batch's two halves,
    and what one sample per process costs, the idle expert running on it too).

    F, the latent frames: spec.data.frames (the video layout's, 4k + 1 frames -> k + 1) once the spec
    has it; until then one, an image's. A per-token timestep (TI2V-5B) is planned as one per sample."""
    experts, vae = list(expert_modules(models).values()), models["vae"]
    transformer = experts[0]
    frames = getattr(spec.data, "frames", None) or 1
    latent_frames = (frames - 1) // vae.config.scale_factor_temporal + 1
    width, height = spec.size
    scale, batch = vae.config.scale_factor_spatial, spec.training.batch_size
    shape = (batch, transformer.config.in_channels, latent_frames, height // scale, width // scale)
    text = make((batch, MAX_TEXT_TOKENS, transformer.config.text_dim), dtype)
    loss = 0.0
    for expert in experts:
        with autocast():
            output = expert(make(shape, dtype), make((batch,), torch.float32), text, return_dict=False)[0]
        loss = loss + mse(output, make(tuple(output.shape), dtype))
    return loss


DEFINITION = FamilyDefinition(
    family=Wan,
    architecture=ARCHITECTURE,
    trained="transformer",
    quantized="transformer",
    forward=planning_forward,
    write_tiny=write_tiny_wan,
    pipeline=PIPELINE,
    scheduler=scheduler,
    write_tokenizers=write_tokenizers,
    model_index=MODEL_INDEX,
    meta_trainable=meta_trainable,
    checkpointing=planning_checkpointing,
    kohya=WAN_ORIGINAL,
    other_lora_files={LOW_NOISE_FILE: {"load_into_transformer_2": True}},
)
