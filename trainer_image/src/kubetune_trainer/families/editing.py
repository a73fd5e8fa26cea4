"""What the image-editing families (FLUX.1 Kontext, Qwen-Image-Edit) share: the edit-pairs data with
caption and control-image dropout, one transformer trained as a LoRA (or fully), held-out pairs
edited as validation samples (scored by CLIP directional similarity with spec.validation.clipModel),
and weights saved through the diffusers pipeline's save_lora_weights.

A family supplies the models (in __init__, then `_prepare_transformer()`), its encoders, the loss,
`pipeline()` and `PIPELINE`, the diffusers pipeline class name whose LoRA loader reads the weights.
Data (the edit-pairs layout) and saving (families.trainable) are every family's.
"""
from __future__ import annotations

import torch

from kubetune_trainer import quantization
from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.families.trainable import diffusers_denoiser


class EditingFamily(ModelFamily):
    PIPELINE: str  # e.g. "FluxKontextPipeline"
    transformer: torch.nn.Module

    def __init__(self, spec, device, weight_dtype):
        super().__init__(spec, device, weight_dtype)
        quantization.check_supported(spec.model.quantization)  # refuse before loading anything

    def _load_transformer(self, cls):
        """The denoiser from `<pretrained>/transformer`, quantized when spec.model.quantization says so."""
        quant = self.spec.model.quantization
        frozen_dtype = self.weight_dtype if self.spec.adapter.type == "lora" else torch.float32
        transformer = cls.from_pretrained(self.spec.model.pretrained, subfolder="transformer", torch_dtype=frozen_dtype,
                                          **quantization.load_kwargs(quant, self.weight_dtype))
        quantization.apply_after_load(quant, transformer, self.weight_dtype)
        return transformer

    def _prepare_transformer(self) -> None:
        """Make the transformer trainable: all of it, or a (possibly pre-initialised) LoRA adapter."""
        self.trainable = diffusers_denoiser(self.transformer, self.spec.adapter, "transformer", self.PIPELINE)
        self.transformer.to(self.device).train()

    # --- output -------------------------------------------------------------------------------

    def pipeline(self):
        """The family's diffusers pipeline over the loaded (and trained) components."""
        raise NotImplementedError

    def held_out_pairs(self, held_out: list[dict]) -> list[tuple[torch.Tensor, str]]:
        """(control pixels, instruction) of the first spec.validation.numSamples held-out pairs."""
        pairs = [(control, caption) for batch in held_out
                 for control, caption in zip(batch["control_values"], batch["captions"])]
        return pairs[:self.spec.validation.num_samples]

    def image_metrics(self, images, held_out, clip):
        """clip_directional of each edited held-out pair against its control image and instruction."""
        from kubetune_trainer.data.images import to_pil

        if not images:
            return {}
        pairs = self.held_out_pairs(held_out)
        return {"clip_directional": clip.clip_directional([to_pil(control) for control, _ in pairs], images,
                                                          [instruction for _, instruction in pairs])}
