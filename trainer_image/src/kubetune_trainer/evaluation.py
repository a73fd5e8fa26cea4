"""Image-quality metrics from a CLIP model (spec.validation.clipModel), to tell which LoRA is better.

clip_score (text-to-image families): 100 * max(cos(E_img(image), E_txt(prompt)), 0), averaged over
the images; the usual definition (Hessel et al. 2021, torchmetrics' CLIPScore), in [0, 100].

clip_directional (editing families): InstructPix2Pix's directional similarity (Brooks et al. 2023,
also diffusers' evaluation guide), cos(E_img(edited) - E_img(control), E_txt(target) - E_txt(source)),
averaged over the pairs, in [-1, 1]: does the image change the way the text changes? Edit pairs carry
an instruction and no captions of the two images, so the text direction is
E_txt(instruction) - E_txt(""), the instruction's offset from saying nothing.

The embeddings are CLIP's projected ones, normalised to unit length. The images come from the same
prompts and the same seed at every validation (kubetune_trainer.validation), so two checkpoints' scores
compare fairly and the same weights score the same.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kubetune_trainer.errors import ConfigError


class ClipScorer:
    """A CLIP model and its preprocessing, loaded once; kept in CPU memory between validations so
    the training's GPU memory is the same with and without it (moving it costs far less than the
    sampling it scores)."""

    def __init__(self, source: str, device: torch.device):
        from transformers import CLIPModel, CLIPProcessor

        try:
            self.model = CLIPModel.from_pretrained(source, dtype=torch.float32).eval()
            processor = CLIPProcessor.from_pretrained(source)
        except (OSError, ValueError) as err:
            reason = str(err).splitlines()[0][:300]
            raise ConfigError(f"spec.validation.clipModel: cannot load a CLIP model from {source} ({reason}); "
                              "give a transformers CLIP folder (config, weights, tokenizer, image processor), "
                              "an s3:// copy of one or a hub id such as openai/clip-vit-large-patch14") from None
        self.model.requires_grad_(False)
        self.tokenizer, self.image_processor = processor.tokenizer, processor.image_processor
        self.device = device

    @torch.no_grad()
    def _image_embeddings(self, images: Sequence) -> torch.Tensor:
        pixels = self.image_processor(images=list(images), return_tensors="pt")["pixel_values"]
        return _unit(_projected(self.model.get_image_features(pixel_values=pixels.to(self.device))))

    @torch.no_grad()
    def _text_embeddings(self, texts: Sequence[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt").to(self.device)
        return _unit(_projected(self.model.get_text_features(**tokens)))

    def _on_device(self):
        return _Borrowed(self.model, self.device)

    def clip_score(self, images: Sequence, prompts: Sequence[str]) -> float:
        """100 * the mean over images of max(cosine(image, its prompt), 0)."""
        _check_lengths(images, prompts)
        with self._on_device():
            cosine = (self._image_embeddings(images) * self._text_embeddings(prompts)).sum(-1)
        return (100 * cosine.clamp(min=0)).mean().item()

    def clip_directional(self, controls: Sequence, edited: Sequence, instructions: Sequence[str]) -> float:
        """The mean over pairs of cos(E(edited) - E(control), E(instruction) - E(""))."""
        _check_lengths(controls, edited, instructions)
        with self._on_device():
            image_direction = self._image_embeddings(edited) - self._image_embeddings(controls)
            text_direction = self._text_embeddings(instructions) - self._text_embeddings([""])
        # An edit that changed nothing has no direction: cosine_similarity's eps makes that 0.
        return F.cosine_similarity(image_direction, text_direction.expand_as(image_direction), dim=-1).mean().item()


class _Borrowed:
    """The model on the device for the block's duration, back in CPU memory after."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device

    def __enter__(self):
        self.model.to(self.device)

    def __exit__(self, *exc):
        self.model.to("cpu")


def _projected(features) -> torch.Tensor:
    """get_*_features returns the projected embedding, or (transformers 5) an output holding it."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def _unit(embeddings: torch.Tensor) -> torch.Tensor:
    return F.normalize(embeddings.float(), dim=-1)


def _check_lengths(*parts: Sequence) -> None:
    if len({len(part) for part in parts}) != 1 or not parts[0]:
        raise ValueError(f"CLIP metrics need as many images as texts, at least one: {[len(p) for p in parts]}")
