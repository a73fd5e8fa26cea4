"""Image-quality metrics from a CLIP model (spec.validation.clipModel), to tell which LoRA is better.

clip_score (text-to-image families): 100 * max(cos(E_img(image), E_txt(prompt)), 0), averaged over
the images; the usual definition (Hessel et al. 2021, torchmetrics' CLIPScore), in [0, 100].

clip_directional (editing families): InstructPix2Pix's directional similarity (Brooks et al. 2023,
also diffusers' evaluation guide), cos(E_img(edited) - E_img(control), E_txt(target) - E_txt(source)),
averaged over the pairs, in [-1, 1]: does the image change the way the text changes? Edit pairs carry
an instruction and no captions of the two images, so the text direction is
E_txt(instruction) - E_txt(""), the instruction's offset from saying nothing.

For `kubetune evaluate` (images generated from held-out prompts, against the held-out images), per
image and averaged (the PMG evaluation guide's metrics that need no network):
- ssim: structural similarity of generated and reference image (Wang et al. 2004: 11-pixel Gaussian
  window, sigma 1.5, K1 0.01, K2 0.03, on [0, 1] pixels, each RGB channel, the map averaged over its
  valid positions), in [-1, 1], 1 for the same image; the reference is resized to the generated size.
- clip_image: cos(E_img(generated), E_img(reference)), in [-1, 1]: does it look like the reference?
- clip_text: cos(E_img(generated), E_txt(prompt)), in [-1, 1]: does it show what was asked (clip_score
  before its x100 and clamp)?
- clip_directional (edit pairs): validation's clip_directional of each edit, from its (first) control
  image: does the edit go where the instruction says?
- lpips (with --lpips-model): the LPIPS distance of generated and reference image (lpips_distance,
  computed here from a torchvision backbone's and the paper's linear weights), >= 0, 0 for the same
  image: lower is closer; the reference is resized to the generated size.
- hps (with --hps-model): a human-preference model in CLIP form (HPS v2: an OpenCLIP ViT-H/14
  fine-tune, converted to the transformers CLIP layout) scoring the image against its prompt as HPS v2
  reports it, 100 * cos(E_img(generated), E_txt(prompt)): higher is preferred (HPS v2's own figures
  are around 20-30).

The embeddings are CLIP's projected ones, normalised to unit length. The images come from the same
prompts and the same seed at every validation (kubetune_trainer.results.validation), so two checkpoints' scores
compare fairly and the same weights score the same.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
        return self.directional_similarity(controls, edited, instructions).mean

    def directional_similarity(self, controls: Sequence, edited: Sequence, instructions: Sequence[str]) -> "Scores":
        """cos(E(edited) - E(control), E(instruction) - E("")) of each pair."""
        _check_lengths(controls, edited, instructions)
        with self._on_device():
            image_direction = self._image_embeddings(edited) - self._image_embeddings(controls)
            text_direction = self._text_embeddings(instructions) - self._text_embeddings([""])
        # An edit that changed nothing has no direction: cosine_similarity's eps makes that 0.
        return Scores.of(F.cosine_similarity(image_direction, text_direction.expand_as(image_direction), dim=-1))


    def image_similarity(self, generated: Sequence, references: Sequence) -> "Scores":
        """cos(E_img(generated), E_img(reference)) of each pair."""
        _check_lengths(generated, references)
        with self._on_device():
            cosine = (self._image_embeddings(generated) * self._image_embeddings(references)).sum(-1)
        return Scores.of(cosine)

    def text_similarity(self, images: Sequence, prompts: Sequence[str]) -> "Scores":
        """cos(E_img(image), E_txt(its prompt)) of each image."""
        _check_lengths(images, prompts)
        with self._on_device():
            cosine = (self._image_embeddings(images) * self._text_embeddings(prompts)).sum(-1)
        return Scores.of(cosine)

    def preference_score(self, images: Sequence, prompts: Sequence[str]) -> "Scores":
        """100 * cos(E_img(image), E_txt(its prompt)): the HPS v2 score when this CLIP is HPS v2's."""
        return Scores([100 * value for value in self.text_similarity(images, prompts).per_image])


@dataclass(frozen=True)
class Scores:
    """A metric of each image, and their mean."""
    per_image: list[float]

    @property
    def mean(self) -> float:
        return sum(self.per_image) / len(self.per_image)

    @classmethod
    def of(cls, values: torch.Tensor) -> "Scores":
        return cls([float(v) for v in values.cpu()])


# --- SSIM ----------------------------------------------------------------------------------------

SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03


def _pixels(image) -> torch.Tensor:
    """A PIL image as a (3, H, W) float tensor in [0, 1]."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)


def _gaussian_taps(size: int, sigma: float) -> torch.Tensor:
    """The 1-D Gaussian weights (summing to 1) whose outer product is the 2-D window: filtering by rows
    then by columns is the 2-D filter at a fraction of its cost."""
    offsets = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    weights = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    return weights / weights.sum()


def ssim_of(x: torch.Tensor, y: torch.Tensor) -> float:
    """SSIM of two (C, H, W) images in [0, 1] of the same size: the mean of the per-channel SSIM maps
    over the window positions that lie inside the image."""
    if x.shape != y.shape:
        raise ValueError(f"SSIM compares images of one size: {tuple(x.shape)} and {tuple(y.shape)}")
    side = min(SSIM_WINDOW, *x.shape[-2:])
    side -= 1 - side % 2  # an odd window that fits a small image
    # The variances are E[x^2] - E[x]^2: taken about each channel's mean, float32 keeps them (a flat
    # image's is exactly 0); the local means add the channel means back.
    x_mean, y_mean = x.mean((1, 2), keepdim=True), y.mean((1, 2), keepdim=True)
    x, y = x - x_mean, y - y_mean
    # The five Gaussian-weighted local means, each channel apart, in one filtering.
    stacked = torch.cat([x, y, x * x, y * y, x * y]).unsqueeze(0)
    taps = _gaussian_taps(side, SSIM_SIGMA).float()
    channels = stacked.shape[1]
    stacked = F.conv2d(stacked, taps.view(1, 1, 1, side).expand(channels, 1, 1, side), groups=channels)
    stacked = F.conv2d(stacked, taps.view(1, 1, side, 1).expand(channels, 1, side, 1), groups=channels)
    mu_x, mu_y, mean_xx, mean_yy, mean_xy = stacked[0].double().chunk(5)
    var_x, var_y, covariance = mean_xx - mu_x ** 2, mean_yy - mu_y ** 2, mean_xy - mu_x * mu_y
    mu_x, mu_y = mu_x + x_mean.double(), mu_y + y_mean.double()
    c1, c2 = SSIM_K1 ** 2, SSIM_K2 ** 2  # the dynamic range is 1
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * covariance + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return ssim_map.mean().item()


def ssim(generated: Sequence, references: Sequence) -> Scores:
    """SSIM of each generated PIL image with its reference (resized to the generated image's size)."""
    from PIL import Image

    _check_lengths(generated, references)
    return Scores([ssim_of(_pixels(image), _pixels(reference.convert("RGB").resize(image.size, Image.BICUBIC)))
                   for image, reference in zip(generated, references)])


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
        raise ValueError(f"these metrics need as many images as texts or references, at least one: "
                         f"{[len(p) for p in parts]}")
