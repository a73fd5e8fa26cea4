"""What a family draws when it samples: the inputs of ModelFamily.sample_images and image_metrics.

Validation builds them from spec.validation (Draw.for_validation); `kubetune generate` and `kubetune
evaluate` from their request (generation.py). The images' other inputs come as batches of the family's
own layout: the held-out captions, edit pairs (the controls given to generate are batched the same way)
or PMG's users with their histories.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kubetune_api.data_layouts import DATA_LAYOUTS


@dataclass(frozen=True)
class Draw:
    prompts: tuple[str, ...] = ()   # text to draw from; none: the held-out samples' own captions
    count: int = 1                  # how many held-out samples to draw (the first ones, in order)
    steps: int = 20                 # denoising steps
    guidance: float | None = None   # the sampler's guidance (None: the pipeline's default)
    seed: int = 0                   # one generator for the whole draw, seeded with this
    held_out: bool = False          # draw held-out samples when no prompts are given (edit pairs: always)

    @classmethod
    def for_validation(cls, spec) -> Draw:
        """spec.validation's draw: its prompts, else its first numSamples held-out samples when a CLIP
        model will score them (edit families draw their held-out pairs always: they have no prompts)."""
        validation = spec.validation
        return cls(prompts=tuple(validation.prompts), count=validation.num_samples,
                   steps=validation.num_inference_steps, guidance=spec.sample_guidance, seed=spec.training.seed,
                   held_out=bool(validation.clip_model) or DATA_LAYOUTS[spec.data.layout].edits)

    def generator(self) -> torch.Generator:
        """A fresh generator at the draw's seed: the same draw always draws the same images."""
        return torch.Generator().manual_seed(self.seed)

    def captions(self, held_out: list[dict]) -> list[str]:
        """A text-to-image draw: the prompts, else the first `count` held-out captions when it draws
        held-out samples."""
        if self.prompts:
            return list(self.prompts)
        if not self.held_out:
            return []
        return [caption for batch in held_out for caption in batch["captions"]][:self.count]

    def pairs(self, held_out: list[dict]) -> list[tuple[torch.Tensor, str]]:
        """An edit: (control pixels [references, 3, H, W], instruction) of the first `count` held-out
        pairs (a family that takes one control image unpacks `[control], instruction`)."""
        pairs = [(controls, caption) for batch in held_out
                 for controls, caption in zip(batch["control_values"], batch["captions"])]
        return pairs[:self.count]
