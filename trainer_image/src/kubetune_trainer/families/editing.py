"""What the image-editing families (FLUX.1 Kontext, Qwen-Image-Edit and -Edit-Plus) share, as
functions they call: CLIP's directional score of the edits (the pairs they edit: Draw.pairs).

Each editing family is a ModelFamily of its own, composed of shared parts: the edit-pairs layout
(data.layouts: caption and control-image dropout), its transformer loaded and trained as every
diffusion family's (families.denoiser: quantized, LoRA or whole) and saved through its diffusers
pipeline's save_lora_weights (families.trainable), and these.
"""
from __future__ import annotations

import torch


def clip_directional(images: list, pairs: list[tuple[torch.Tensor, str]], clip) -> dict[str, float]:
    """clip_directional of each edited held-out pair (`images`, drawn from `pairs`) against its
    (first) control image and instruction."""
    from kubetune_trainer.data.images import to_pil

    if not images:
        return {}
    return {"clip_directional": clip.clip_directional([to_pil(controls[0]) for controls, _ in pairs], images,
                                                      [instruction for _, instruction in pairs])}


def instruction_variants(family, pairs: list[tuple[str, torch.Tensor]], full: list[str]) -> list[list[tuple]]:
    """For a family whose text encoder reads (instruction, control pixels): per pair, the other forms
    an epoch may draw (what the embedding cache stores beside it): its control pixels mirrored, and
    the caption dropout did not draw (a dropped control image is not among them)."""
    captions = family.caption_variants([caption for caption, _ in pairs], full)
    mirrors = family.mirror_variants([control for _, control in pairs])
    variants = []
    for (caption, control), other_captions, other_controls in zip(pairs, captions, mirrors):
        forms = [(c, image) for c in [caption, *other_captions] for image in [control, *other_controls]]
        variants.append(forms[1:])  # the first is the pair itself
    return variants
