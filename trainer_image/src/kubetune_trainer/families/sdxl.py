"""SDXL: LoRA (or full) fine-tuning of the UNet; two text encoders, size and crop conditioning."""
from __future__ import annotations

import torch

from kubetune_trainer.device_copy import to_device
from kubetune_trainer.families.sd15 import StableDiffusion15, UNetDiffusion


def time_ids(crops, height: int, width: int) -> torch.Tensor:
    """SDXL's micro-conditioning per sample: original size, crop top-left, target size."""
    return torch.tensor([[*c.original_size, *c.top_left, height, width] for c in crops], dtype=torch.float32)


class XLDiffusion(UNetDiffusion):
    """SDXL's parts: SD1.5's, with two text encoders and size and crop conditioning."""

    pipeline_class = "StableDiffusionXLPipeline"

    def load_text_encoders(self, root: str) -> None:
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        self.tokenizers = [CLIPTokenizer.from_pretrained(root, subfolder="tokenizer"),
                           CLIPTokenizer.from_pretrained(root, subfolder="tokenizer_2")]
        self.text_encoders = [
            CLIPTextModel.from_pretrained(root, subfolder="text_encoder", torch_dtype=self.weight_dtype),
            CLIPTextModelWithProjection.from_pretrained(root, subfolder="text_encoder_2", torch_dtype=self.weight_dtype),
        ]

    @torch.no_grad()
    def encode_prompts(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """Both encoders' penultimate hidden states side by side, plus the second one's pooled output."""
        hidden = []
        for tokenizer, encoder in zip(self.tokenizers, self.text_encoders):
            tokens = tokenizer(captions, padding="max_length", truncation=True,
                               max_length=tokenizer.model_max_length, return_tensors="pt")
            output = encoder(to_device(tokens.input_ids, self.device), output_hidden_states=True)
            hidden.append(output.hidden_states[-2])
        return {"prompt_embeds": torch.cat(hidden, dim=-1), "pooled": output[0]}

    def conditioning(self, batch, text):
        height, width = batch["pixel_values"].shape[-2:]
        ids = to_device(time_ids(batch["crops"], height, width), self.device, text["prompt_embeds"].dtype)
        return {"encoder_hidden_states": text["prompt_embeds"],
                "added_cond_kwargs": {"text_embeds": text["pooled"], "time_ids": ids}}


class StableDiffusionXL(StableDiffusion15):
    DIFFUSION = XLDiffusion
