"""The model families in one torch-free table: what each reads, trains, reports and honours.

Every other list of families derives from FAMILIES: the spec's `family` enum, the layout rule,
the native resolutions, the metrics validation.monitor may name, and the rules that refuse an
option a family would otherwise ignore (kubetune_api.spec.OPTION_RULES, which the CRD's CEL, the
webhook and `kubetune validate` all share). The trainer's registry (kubetune_trainer.families),
the tiny-model writers and the planner's model lists are keyed by the same names; a test asserts
the sets are equal, and another trains each family with each option it honours to show it acts.
"""
from __future__ import annotations

from dataclasses import dataclass

# The options whose effect depends on the family, by manifest path. What "set" means for each
# (its CEL and Python test) is in kubetune_api.spec.FAMILY_OPTIONS.
QUANTIZATION = "spec.model.quantization"
INIT_FROM = "spec.adapter.initFrom"
FULL_FINE_TUNE = "spec.adapter.type"          # full; every family trains a LoRA-style adapter
LORA_RANK = "spec.adapter.rank"
LORA_ALPHA = "spec.adapter.alpha"
LORA_DROPOUT = "spec.adapter.dropout"
LORA_TARGETS = "spec.adapter.targetModules"
BUCKETING = "spec.data.bucketing"
CAPTION_DROPOUT = "spec.data.captionDropout"
CONTROL_DROPOUT = "spec.data.controlDropout"
EMBEDDING_CACHE = "spec.data.cache.enabled"
SNR_GAMMA = "spec.training.snrGamma"
NOISE_OFFSET = "spec.training.noiseOffset"
VALIDATION_PROMPTS = "spec.validation.prompts"
CLIP_MODEL = "spec.validation.clipModel"       # scores validation images: clip_score / clip_directional

LORA_SHAPE = frozenset({LORA_RANK, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS, INIT_FROM})
DENOISING = frozenset({SNR_GAMMA, NOISE_OFFSET})       # a DDPM noise-prediction loss's knobs
IMAGE_DIFFUSION = frozenset({QUANTIZATION, FULL_FINE_TUNE, BUCKETING, CAPTION_DROPOUT, EMBEDDING_CACHE})
# What a CLIP model (CLIP_MODEL) measures on the images validation samples: how well a text-to-image
# family's image matches its prompt; how well an editing family's edit follows its instruction.
TEXT_TO_IMAGE_METRICS = ("loss", "clip_score")
EDITING_METRICS = ("loss", "clip_directional")


@dataclass(frozen=True)
class FamilyInfo:
    name: str                        # spec.model.family
    summary: str                     # "trains ...": what refusals say of it
    layouts: tuple[str, ...]         # spec.data.layout values it reads
    native_resolution: int | None    # when spec.data.resolution is unset (None: the model's own size)
    metrics: tuple[str, ...]         # what its validation may report (spec.validation.monitor); the
                                     # CLIP ones only with spec.validation.clipModel
    honours: frozenset[str]          # the options above that it applies; any other is refused


FAMILIES: dict[str, FamilyInfo] = {family.name: family for family in (
    FamilyInfo("sd15", "trains a Stable Diffusion 1.5 UNet by DDPM noise prediction",
               ("captions",), 512, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | DENOISING | {VALIDATION_PROMPTS, CLIP_MODEL}),
    FamilyInfo("sdxl", "trains a Stable Diffusion XL UNet by DDPM noise prediction",
               ("captions",), 1024, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | DENOISING | {VALIDATION_PROMPTS, CLIP_MODEL}),
    FamilyInfo("flux-kontext", "trains a FLUX.1 Kontext editing transformer by flow matching",
               ("edit-pairs",), 1024, EDITING_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {CONTROL_DROPOUT, CLIP_MODEL}),
    FamilyInfo("qwen-image-edit", "trains a Qwen-Image-Edit transformer by flow matching",
               ("edit-pairs",), 1024, EDITING_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {CONTROL_DROPOUT, CLIP_MODEL}),
    FamilyInfo("pmg", "trains soft prompts, a prefix and a mapping layer for a frozen Stable Diffusion 1.5",
               ("pmg",), 512, TEXT_TO_IMAGE_METRICS,
               frozenset({QUANTIZATION, EMBEDDING_CACHE, CLIP_MODEL}) | DENOISING),
    FamilyInfo("classifier", "trains a transformers image classifier by cross-entropy",
               ("image-folder",), None, ("loss", "accuracy", "f1"),
               frozenset({FULL_FINE_TUNE, LORA_RANK, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS})),
)}

FAMILY_NAMES = tuple(FAMILIES)
OPTIONS = (QUANTIZATION, INIT_FROM, FULL_FINE_TUNE, LORA_RANK, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS, BUCKETING,
           CAPTION_DROPOUT, CONTROL_DROPOUT, EMBEDDING_CACHE, SNR_GAMMA, NOISE_OFFSET, VALIDATION_PROMPTS,
           CLIP_MODEL)


def label(option: str) -> str:
    """How messages and docs name OPTION: its field, and the value that acts when only one does."""
    return f"{option} full" if option == FULL_FINE_TUNE else option


def honouring(option: str) -> list[str]:
    """The families that apply OPTION, in table order."""
    return [name for name, family in FAMILIES.items() if option in family.honours]


def markdown() -> str:
    """docs/families.md: the table as people read it (`python -m kubetune_api.families > docs/families.md`)."""
    lines = ["# Model families and the options each honours", "",
             "Generated from `kubetune_api/families.py` by `python -m kubetune_api.families`; do not edit.",
             "An option a family does not honour is refused by `kubectl apply`, the webhook and",
             "`kubetune validate`, naming the field and the family (it would otherwise do nothing).",
             "clip_score and clip_directional are measured when `spec.validation.clipModel` names a CLIP model.", "",
             "| family | trains | layout | native size | validation metrics |", "|---|---|---|---|---|"]
    for family in FAMILIES.values():
        size = family.native_resolution or "the model's own"
        lines.append(f"| {family.name} | {family.summary.removeprefix('trains ')} | {', '.join(family.layouts)} "
                     f"| {size} | {', '.join(family.metrics)} |")
    lines += ["", "| option | " + " | ".join(FAMILY_NAMES) + " |", "|---|" + "---|" * len(FAMILY_NAMES)]
    for option in OPTIONS:
        marks = " | ".join("yes" if option in FAMILIES[name].honours else "refused" for name in FAMILY_NAMES)
        lines.append(f"| `{label(option)}` | {marks} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
