"""The model families in one torch-free table: what each reads, trains, reports and honours.

A family is one module and one row: this row, and its trainer module
kubetune_trainer/families/<name, "-" as "_">.py, whose DEFINITION declares the trainer's facts
(kubetune_trainer/families/definition.py says how to write one). Every other list of families derives from these two: the
spec's `family` enum, the layout rule, the native resolutions, the metrics validation.monitor may
name, the rules that refuse an option a family would otherwise ignore (kubetune_api.spec.OPTION_RULES,
which the CRD's CEL, the webhook and `kubetune validate` all share), the operator's fit check
(each row's `profile`), the trainer's registry, planner, tiny models and reference architectures.
tests/unit/test_families_table.py shows it; tests/trainer/test_family_options.py trains each family
with each option it honours to show it acts.
"""
from __future__ import annotations

from dataclasses import dataclass

# The options whose effect depends on the family, by manifest path. What "set" means for each
# (its CEL and Python test) is in kubetune_api.spec.FAMILY_OPTIONS.
QUANTIZATION = "spec.model.quantization"
VAE = "spec.model.vae"                         # another VAE than the model's own
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
ENCODER_DEVICE = "spec.model.encoderDevice"  # where the frozen encoders live while the cache feeds the step
SNR_GAMMA = "spec.training.snrGamma"
NOISE_OFFSET = "spec.training.noiseOffset"
VALIDATION_PROMPTS = "spec.validation.prompts"
GUIDANCE = "spec.validation.guidanceScale"     # the sample images' guidance (the family's default: its row)
CLIP_MODEL = "spec.validation.clipModel"       # scores validation images: clip_score / clip_directional
EXPERTS = "spec.model.experts"                 # which expert(s) of a two-expert (mixture-of-experts) denoiser train

LORA_SHAPE = frozenset({LORA_RANK, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS, INIT_FROM})
DENOISING = frozenset({SNR_GAMMA, NOISE_OFFSET})       # a DDPM noise-prediction loss's knobs
IMAGE_DIFFUSION = frozenset({QUANTIZATION, VAE, FULL_FINE_TUNE, BUCKETING, CAPTION_DROPOUT, EMBEDDING_CACHE,
                             ENCODER_DEVICE, GUIDANCE})
# What a CLIP model (CLIP_MODEL) measures on the images validation samples: how well a text-to-image
# family's image matches its prompt; how well an editing family's edit follows its instruction.
TEXT_TO_IMAGE_METRICS = ("loss", "clip_score")
EDITING_METRICS = ("loss", "clip_directional")


# --- the operator's coarse fit check (kubetune_api.fit) --------------------------------------------
# Each row's `profile` describes the family's standard architecture (kubetune_trainer's reference
# architecture) in numbers: calibrated from the meta-device estimator with
# `python -m kubetune_trainer.planning.profiles FAMILY`, which prints the FamilyProfile to paste into the row.

@dataclass(frozen=True)
class Dynamic:
    """Bytes of activations saved for backward plus backward's working memory, in bf16 with autocast:
    per_step + batch * (per_sample + per_pixel * resolution**2)."""

    per_step: float
    per_sample: float
    per_pixel: float

    def bytes(self, batch: int, resolution: int) -> float:
        return self.per_step + batch * (self.per_sample + self.per_pixel * resolution * resolution)


@dataclass(frozen=True)
class FamilyProfile:
    trained_module: int     # parameters of the module DDP wraps / FSDP shards, before LoRA (the denoiser)
    linear_weights: int     # of which in Linear weights (what nf4 and fp8 store quantized)
    frozen: int             # parameters of every other model the trainer loads (encoders, VAE, LM)
    lora_per_rank: int      # LoRA parameters per unit of rank on the default target modules
    adapter: int            # trained parameters besides a LoRA: PMG's adapter, the classifier's new head
    largest_unit: int       # parameters of the largest block FSDP gathers at once
    loads_fp32: bool        # the trained module loads in fp32 whatever the precision (the classifier)
    dynamic: dict           # (adapter type, gradient checkpointing) -> Dynamic
    image_size: int | None = None  # the standard model's own size, for a family without a native resolution


@dataclass(frozen=True)
class FrameRule:
    """The frame counts a video family's model takes per sample: multiple * k + remainder, at least 1.

    Wan's VAE keeps the first frame and compresses each later 4 into one latent frame: 4k+1
    (FrameRule(4, 1): 1, 5, 9, ..., 81). The default takes any count. spec.data.frames is refused,
    naming the nearest counts that fit, by the rule kubetune_api.spec derives from each row's."""

    multiple: int = 1
    remainder: int = 0

    def allows(self, frames: int) -> bool:
        return frames >= 1 and frames % self.multiple == self.remainder % self.multiple

    def nearest(self, frames: int) -> list[int]:
        """The counts that fit just below and just above FRAMES (below only where there is one)."""
        below = next((n for n in range(frames - 1, 0, -1) if self.allows(n)), None)
        above = next(n for n in range(frames + 1, frames + self.multiple + 2) if self.allows(n))
        return [n for n in (below, above) if n is not None]

    def describe(self) -> str:
        if self.multiple == 1:
            return "any count"
        first = [n for n in range(1, 3 * self.multiple + 2) if self.allows(n)][:3]
        return f"{self.multiple}k+{self.remainder % self.multiple} ({', '.join(map(str, first))}, ...)"


ANY_FRAMES = FrameRule()


@dataclass(frozen=True)
class FamilyInfo:
    name: str                        # spec.model.family
    summary: str                     # "trains ...": what refusals say of it
    layouts: tuple[str, ...]         # spec.data.layout values it reads
    native_resolution: int | None    # when spec.data.resolution is unset (None: the model's own size)
    metrics: tuple[str, ...]         # what its validation may report (spec.validation.monitor); the
                                     # CLIP ones only with spec.validation.clipModel
    honours: frozenset[str]          # the options above that it applies; any other is refused
    profile: FamilyProfile | None = None  # its standard architecture in numbers, for the operator's fit
                                          # check (None: no check)
    own_adapter: bool = False        # trains parts of its own whatever spec.adapter says (PMG's soft
                                     # prompts): no LoRA shape, no full fine-tune
    options: str | None = None       # the spec block of its own options (spec.pmg), refused for other families
    guidance: float | None = None    # sample images' guidance without spec.validation.guidanceScale (None:
                                     # its diffusers pipeline's default)
    resolution_multiple: int = 8     # spec.data.resolution must be a multiple of it: the VAE's downscale
                                     # times the transformer's patch size (8 x 2 for the packed DiTs)
    max_references: int = 1          # edit-pairs: control images a sample may have (control_images/NAME.* or
                                     # NAME_0.*, NAME_1.*, ...); a sample with more is refused naming its files
    frame_rule: FrameRule = ANY_FRAMES  # video layouts: the frame counts per sample (spec.data.frames) its
                                        # model takes; another count is refused naming the nearest that fit


FAMILIES: dict[str, FamilyInfo] = {family.name: family for family in (
    FamilyInfo("sd15", "trains a Stable Diffusion 1.5 UNet by DDPM noise prediction",
               ("captions",), 512, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | DENOISING | {VALIDATION_PROMPTS, CLIP_MODEL},
               profile=FamilyProfile(
                   trained_module=859_520_964, linear_weights=270_049_280, frozen=206_714_343,
                   lora_per_rank=199_296, adapter=0, largest_unit=258_330_880, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(3.324e+06, 7.683e+06, 4477),
                            ("lora", True): Dynamic(1.395e+05, 4.63e+05, 1133),
                            ("full", False): Dynamic(1.679e+09, 4.042e+06, 5058),
                            ("full", True): Dynamic(2.484e+08, -7.929e+06, 1196)})),
    FamilyInfo("sdxl", "trains a Stable Diffusion XL UNet by DDPM noise prediction",
               ("captions",), 1024, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | DENOISING | {VALIDATION_PROMPTS, CLIP_MODEL},
               profile=FamilyProfile(
                   trained_module=2_567_463_684, linear_weights=2_232_647_680, frozen=901_374_183,
                   lora_per_rank=1_451_520, adapter=0, largest_unit=1_206_568_960, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(2.076e+07, 6.996e+07, 7395),
                            ("lora", True): Dynamic(5.76e+04, 7.312e+06, 823.8),
                            ("full", False): Dynamic(4.442e+09, 2.602e+07, 8735),
                            ("full", True): Dynamic(2.608e+08, -2.662e+07, 891)})),
    FamilyInfo("flux-kontext", "trains a FLUX.1 Kontext editing transformer by flow matching",
               ("edit-pairs",), 1024, EDITING_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {CONTROL_DROPOUT, CLIP_MODEL}, guidance=2.5,  # distilled guidance
               resolution_multiple=16,
               profile=FamilyProfile(
                   trained_module=11_901_408_320, linear_weights=11_898_322_944, frozen=4_969_190_819,
                   lora_per_rank=1_167_360, adapter=0, largest_unit=339_831_296, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(2.123e+07, 3.005e+09, 4.98e+04),
                            ("lora", True): Dynamic(3.017e+06, 2.53e+08, 4189),
                            ("full", False): Dynamic(2.377e+10, 5.006e+09, 7.656e+04),
                            ("full", True): Dynamic(7.769e+08, 3.107e+08, 4957)})),
    FamilyInfo("qwen-image-edit", "trains a Qwen-Image-Edit transformer by flow matching",
               ("edit-pairs",), 1024, EDITING_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {CONTROL_DROPOUT, CLIP_MODEL}, guidance=4.0,  # true CFG, model card
               resolution_multiple=16,
               profile=FamilyProfile(
                   trained_module=20_430_401_088, linear_weights=20_424_818_688, frozen=8_419_059_187,
                   lora_per_rank=1_474_560, adapter=0, largest_unit=339_831_296, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(2.659e+07, 6.605e+08, 7.145e+04),
                            ("lora", True): Dynamic(3.539e+06, 4.59e+07, 4974),
                            ("full", False): Dynamic(4.085e+10, 1.341e+09, 1.23e+05),
                            ("full", True): Dynamic(7.617e+08, 5.943e+07, 5997)})),
    FamilyInfo("z-image", "trains a Z-Image (Turbo or base) transformer by flow matching",
               ("captions",), 1024, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {VALIDATION_PROMPTS, CLIP_MODEL},
               guidance=0.0,  # Turbo is step-distilled: no classifier-free guidance; the base model samples at 3-5
               resolution_multiple=16,
               profile=FamilyProfile(
                   trained_module=6_154_908_736, linear_weights=6_153_863_168, frozen=4_106_287_779,
                   lora_per_rank=1_044_480, adapter=0, largest_unit=180_910_336, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(1.634e+07, 4.304e+09, 3.283e+04),
                            ("lora", True): Dynamic(4.915e+05, 2.852e+08, 2178),
                            ("full", False): Dynamic(1.231e+10, 7.124e+09, 5.476e+04),
                            ("full", True): Dynamic(3.844e+08, 5.159e+08, 3878)})),
    FamilyInfo("sd35", "trains a Stable Diffusion 3.5 transformer by flow matching",
               ("captions",), 1024, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {VALIDATION_PROMPTS, CLIP_MODEL},
               guidance=3.5,  # large's model card (its pipeline's default, 7.0, is SD3's); medium's card samples at 4.5
               resolution_multiple=16,
               profile=FamilyProfile(  # SD 3.5 large (trainer_image/.../families/sd35.py)
                   trained_module=8_056_627_520, linear_weights=8_053_694_464, frozen=5_664_440_483,
                   lora_per_rank=739_328, adapter=0, largest_unit=212_999_680, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(1.171e+07, 1.094e+09, 1.612e+04),
                            ("lora", True): Dynamic(3.113e+05, 9.095e+07, 1334),
                            ("full", False): Dynamic(1.608e+10, 2.263e+09, 2.703e+04),
                            ("full", True): Dynamic(4.738e+08, 1.245e+08, 1676)})),
    FamilyInfo("qwen-image", "trains a Qwen-Image text-to-image transformer by flow matching",
               ("captions",), 1024, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {VALIDATION_PROMPTS, CLIP_MODEL}, guidance=4.0,  # true CFG, model card
               resolution_multiple=16,
               profile=FamilyProfile(
                   trained_module=20_430_401_088, linear_weights=20_424_818_688, frozen=8_419_059_187,
                   lora_per_rank=1_474_560, adapter=0, largest_unit=339_831_296, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(2.607e+07, 4.941e+08, 3.196e+04),
                            ("lora", True): Dynamic(3.015e+06, 3.507e+07, 2213),
                            ("full", False): Dynamic(4.085e+10, 1.018e+09, 5.367e+04),
                            ("full", True): Dynamic(7.611e+08, 4.533e+07, 2646)})),
    FamilyInfo("qwen-image-edit-plus", "trains a Qwen-Image-Edit-2509/2511 transformer by flow matching",
               ("edit-pairs",), 1024, EDITING_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {CONTROL_DROPOUT, CLIP_MODEL}, max_references=3,
               guidance=4.0, resolution_multiple=16,  # true CFG, as the model card samples
               # calibrated with three references per sample (the most costly; the planning forward's)
               profile=FamilyProfile(
                   trained_module=20_430_401_088, linear_weights=20_424_818_688, frozen=8_419_059_187,
                   lora_per_rank=1_474_560, adapter=0, largest_unit=339_831_296, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(2.764e+07, 4.492e+09, 1.508e+05),
                            ("lora", True): Dynamic(4.588e+06, 3.241e+08, 9232),
                            ("full", False): Dynamic(4.083e+10, 9.308e+09, 2.377e+05),
                            ("full", True): Dynamic(7.627e+08, 4.181e+08, 1.096e+04)})),
    FamilyInfo("flux2", "trains a FLUX.2 [dev] transformer by flow matching, on captions or with reference images",
               ("captions", "edit-pairs"), 1024, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {VALIDATION_PROMPTS, CLIP_MODEL},
               guidance=4.0,  # the guidance-distilled transformer's embedded guidance, Flux2Pipeline's default
               resolution_multiple=16, max_references=6,  # BFL's recommended most for [dev]
               profile=FamilyProfile(
                   trained_module=32_223_281_152, linear_weights=32_223_264_768, frozen=23_424_318_755,
                   lora_per_rank=4_816_896, adapter=0, largest_unit=981_467_648, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(7.841e+07, 9.002e+09, 7.051e+04),
                            ("lora", True): Dynamic(3.048e+06, 6.286e+08, 4906),
                            ("full", False): Dynamic(6.425e+10, 1.067e+10, 8.15e+04),
                            ("full", True): Dynamic(3.401e+09, 7.011e+08, 5483)})),
    FamilyInfo("flux2-klein", "trains a FLUX.2 [klein] transformer by flow matching, on captions or with reference "
               "images", ("captions", "edit-pairs"), 1024, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {VALIDATION_PROMPTS, CLIP_MODEL},
               guidance=4.0,  # a base model's classifier-free guidance; a step-distilled one samples without
               resolution_multiple=16, max_references=4,  # BFL's most for [klein] 4B and 9B
               profile=FamilyProfile(
                   trained_module=3_875_544_576, linear_weights=3_875_536_896, frozen=4_106_514_211,
                   lora_per_rank=1_044_480, adapter=0, largest_unit=245_367_296, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(1.817e+07, 2.007e+09, 1.595e+04),
                            ("lora", True): Dynamic(2.311e+06, 2.163e+08, 1713),
                            ("full", False): Dynamic(7.703e+09, 2.443e+09, 1.871e+04),
                            ("full", True): Dynamic(8.328e+08, 2.525e+08, 2002)})),
    FamilyInfo("wan", "trains a Wan 2.1/2.2 text- or image-to-video transformer (or a Wan 2.2 expert) by flow "
               "matching",
               # video clips, or images as 1-frame clips; 480: 480p's short side
               ("captions", "video-captions"), 480, TEXT_TO_IMAGE_METRICS,
               IMAGE_DIFFUSION | LORA_SHAPE | {VALIDATION_PROMPTS, CLIP_MODEL, EXPERTS},
               frame_rule=FrameRule(4, 1),  # the VAE's temporal grid: 1 + 4k frames (81 published)
               guidance=5.0,  # WanPipeline's default and Wan 2.1's published sampling guidance
               resolution_multiple=16,  # 8x VAE, 2x2 patches (the 5B's 16x VAE needs 32: the trainer checks)
               # one 14B expert (Wan2.1-T2V-14B = each Wan2.2-T2V-A14B expert), 1-frame clips; experts both holds two
               profile=FamilyProfile(
                   trained_module=14_288_491_584, linear_weights=14_283_243_520, frozen=5_807_802_867,
                   lora_per_rank=3_276_800, adapter=0, largest_unit=351_394_304, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(5.107e+07, 1.265e+09, 4.301e+04),
                            ("lora", True): Dynamic(1.794e+06, 3.643e+07, 2970),
                            ("full", False): Dynamic(2.852e+10, 8.644e+08, 5.712e+04),
                            ("full", True): Dynamic(1.124e+09, 4.014e+07, 3440)})),
    FamilyInfo("pmg", "trains soft prompts, a prefix and a mapping layer for a frozen Stable Diffusion 1.5",
               ("pmg",), 512, TEXT_TO_IMAGE_METRICS,
               frozenset({QUANTIZATION, VAE, EMBEDDING_CACHE, CLIP_MODEL, GUIDANCE}) | DENOISING, own_adapter=True,
               options="pmg",
               profile=FamilyProfile(
                   trained_module=859_520_964, linear_weights=270_049_280, frozen=6_945_129_959,
                   lora_per_rank=0, adapter=3_680_512, largest_unit=3_680_512, loads_fp32=False,
                   dynamic={("lora", False): Dynamic(6.291e+06, 1.097e+09, 2961),
                            ("lora", True): Dynamic(1.153e+07, 6.687e+07, 931.2),
                            ("full", False): Dynamic(6.291e+06, 1.097e+09, 2961),
                            ("full", True): Dynamic(1.153e+07, 6.687e+07, 931.2)})),
    FamilyInfo("classifier", "trains a transformers image classifier by cross-entropy",
               ("image-folder",), None, ("loss", "accuracy", "precision", "recall", "f1"),
               frozenset({FULL_FINE_TUNE, LORA_RANK, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS}),
               profile=FamilyProfile(
                   trained_module=86_567_656, linear_weights=85_702_656, frozen=0,
                   lora_per_rank=36_864, adapter=769_000, largest_unit=7_087_872, loads_fp32=True, image_size=224,
                   dynamic={("lora", False): Dynamic(1.684e+08, 0, 1066),
                            ("lora", True): Dynamic(1.574e+07, 0, 277.9),
                            ("full", False): Dynamic(1.726e+08, 0, 1589),
                            ("full", True): Dynamic(1.687e+07, 0, 326)})),
)}

FAMILY_NAMES = tuple(FAMILIES)
OPTIONS = (QUANTIZATION, VAE, INIT_FROM, FULL_FINE_TUNE, LORA_RANK, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS, BUCKETING,
           CAPTION_DROPOUT, CONTROL_DROPOUT, EMBEDDING_CACHE, ENCODER_DEVICE, SNR_GAMMA, NOISE_OFFSET, VALIDATION_PROMPTS,
           GUIDANCE, CLIP_MODEL, EXPERTS)


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
             "| family | trains | layout | native size | validation metrics | sample guidance |",
             "|---|---|---|---|---|---|"]
    for family in FAMILIES.values():
        size = family.native_resolution or "the model's own"
        guidance = (family.guidance if family.guidance is not None
                    else "the pipeline's default" if GUIDANCE in family.honours else "-")
        layouts = ", ".join(family.layouts) + (f" (1-{family.max_references} control images per sample)"
                                               if family.max_references > 1 else "")
        if family.frame_rule != ANY_FRAMES:
            layouts += f" (frames {family.frame_rule.describe()})"
        lines.append(f"| {family.name} | {family.summary.removeprefix('trains ')} | {layouts} "
                     f"| {size} | {', '.join(family.metrics)} | {guidance} |")
    lines += ["", "| option | " + " | ".join(FAMILY_NAMES) + " |", "|---|" + "---|" * len(FAMILY_NAMES)]
    for option in OPTIONS:
        marks = " | ".join("yes" if option in FAMILIES[name].honours else "refused" for name in FAMILY_NAMES)
        lines.append(f"| `{label(option)}` | {marks} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
