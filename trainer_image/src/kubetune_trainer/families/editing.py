"""What the image-editing families (FLUX.1 Kontext, Qwen-Image-Edit) share: the edit-pairs data with
caption and control-image dropout, one transformer trained as a LoRA (or fully), held-out pairs
edited as validation samples (scored by CLIP directional similarity with spec.validation.clipModel),
and weights saved through the diffusers pipeline's save_lora_weights.

A family supplies the models (in __init__, then `_prepare_transformer()`), its encoders, the loss,
`pipeline()` and `PIPELINE`, the diffusers pipeline class name whose LoRA loader reads the weights.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kubetune_trainer import quantization
from kubetune_trainer.data.edit_pairs import EditPairsDataset, collate, read_edit_pairs
from kubetune_trainer.families.base import ModelFamily, save_diffusers_model
from kubetune_trainer.families.lora import attach_lora, load_lora_init, lora_layers


class EditingFamily(ModelFamily):
    PIPELINE: str  # e.g. "FluxKontextPipeline"
    LORA_TARGETS: list[str]
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
        if self.spec.adapter.type == "full":
            self.transformer.requires_grad_(True)
        else:
            attach_lora(self.transformer, self.spec.adapter, self.LORA_TARGETS)
            if self.spec.adapter.init_from:
                load_lora_init(self.transformer, self.spec.adapter.init_from, "transformer")
        self.transformer.to(self.device).train()

    @property
    def trainable_module(self):
        return self.transformer

    # --- data ---------------------------------------------------------------------------------

    def read_samples(self):
        return read_edit_pairs(Path(self.spec.data.uri), self.screen)

    def make_dataset(self, samples, training):
        data = self.spec.data
        transform = self.image_transform(training)
        return EditPairsDataset(samples, transform, data.caption_dropout if training else 0.0,
                                data.control_dropout if training else 0.0, self.spec.training.seed, data.bucketing)

    def collate(self, items):
        return collate(items)

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

    def save_weights(self, out_dir: Path, trained: dict[str, torch.Tensor]) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.adapter.type == "full":
            return save_diffusers_model(self.transformer, trained, out_dir / "transformer")
        import diffusers

        getattr(diffusers, self.PIPELINE).save_lora_weights(
            out_dir, transformer_lora_layers=lora_layers(self.transformer, trained), safe_serialization=True,
            transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict(),
        )
        return [out_dir / "pytorch_lora_weights.safetensors"]
