"""A LoRA's tensors under the key names tools outside diffusers use (`kubetune export --format kohya`).

The trainer saves a LoRA as diffusers' `save_lora_weights` writes it: `<component>.<module>.lora.down.weight`
(diffusers' older names) or `<component>.<module>.lora_A.weight` (PEFT's), the scale alpha/r in the
file's metadata. ComfyUI, kohya's sd-scripts, A1111/Forge and musubi-tuner name the same tensors
`<prefix><module>.lora_down.weight` / `.lora_up.weight` with a scalar `.alpha` beside them; the
prefix, and whether the module path keeps its dots, is the convention. Each family declares the one
its tools use (FamilyDefinition.kohya), where diffusers' own loader reads it back, so a file
exported here can be checked by loading it through diffusers.

Importing this module is cheap (family modules import it for their DEFINITION): torch is imported
inside the functions.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The two spellings diffusers writes a LoRA pair in, then the one kohya-style tools read.
_DOWN_UP = ((".lora.down.weight", ".lora.up.weight"), (".lora_A.weight", ".lora_B.weight"))
KOHYA_DOWN, KOHYA_UP, KOHYA_ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"


class UnconvertibleLora(ValueError):
    """A LoRA file this convention cannot express (a tensor that is no down/up pair, a missing scale)."""


@dataclass(frozen=True)
class LoraKeyConvention:
    """How a family's non-diffusers tools name a LoRA's tensors."""

    name: str                      # as docs and messages call it
    read_by: str                   # the tools known to load it (docs, --help)
    prefixes: Mapping[str, str]    # the diffusers file's component prefix -> this convention's key prefix
    flat: bool                     # the module path's dots become underscores (kohya's lora_unet_down_blocks_0_…)
    # Where the tools use the original model's module names rather than diffusers' (Wan): (a regular
    # expression over the diffusers module path, its replacement); a module none matches is refused.
    renames: tuple[tuple[str, str], ...] = ()

    def key(self, component: str, module: str) -> str:
        if component not in self.prefixes:
            raise UnconvertibleLora(f"the {self.name} convention has no name for LoRA weights of {component!r} "
                                    f"(it names {', '.join(self.prefixes)})")
        module = self.original_name(module)
        return self.prefixes[component] + (module.replace(".", "_") if self.flat else module)

    def original_name(self, module: str) -> str:
        for pattern, replacement in self.renames:
            renamed, found = re.subn(pattern, replacement, module)
            if found:
                return renamed
        if self.renames:
            raise UnconvertibleLora(f"the {self.name} convention has no name for the adapted module {module!r} "
                                    "(spec.adapter.targetModules beyond what it names)")
        return module


# kohya's sd-scripts for Stable Diffusion: the diffusers module path flattened (kohya trains SD 1.x on
# the diffusers UNet and names its modules so); ComfyUI maps these names for SD1.5 and SDXL alike.
KOHYA_UNET = LoraKeyConvention(
    name="kohya (lora_unet_/lora_te_)",
    read_by="ComfyUI, kohya sd-scripts, A1111/Forge, diffusers load_lora_weights",
    prefixes={"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"},
    flat=True,
)

# ComfyUI's (and musubi-tuner's, ai-toolkit's) naming for DiTs whose original checkpoint uses the
# diffusers module names (Qwen-Image, Z-Image): the model's own path under `diffusion_model.`.
DIFFUSION_MODEL = LoraKeyConvention(
    name="ComfyUI (diffusion_model.)",
    read_by="ComfyUI, musubi-tuner, ai-toolkit, diffusers load_lora_weights",
    prefixes={"transformer": "diffusion_model."},
    flat=False,
)


# Wan's own checkpoint names (ComfyUI's Wan model, musubi-tuner, the Wan 2.1/2.2 repositories) under
# `diffusion_model.`: a block's self_attn / cross_attn (q, k, v, o; k_img, v_img of image-to-video) and
# its ffn.0 / ffn.2, for diffusers' attn1 / attn2 (to_q, …, to_out.0; add_k_proj, add_v_proj) and ffn.net.
_BLOCK = r"^(blocks\.\d+)\."
WAN_ORIGINAL = LoraKeyConvention(
    name="Wan (diffusion_model. with Wan's module names)",
    read_by="ComfyUI, musubi-tuner, diffusers load_lora_weights",
    prefixes={"transformer": "diffusion_model."},
    flat=False,
    renames=(
        (_BLOCK + r"attn1\.to_(q|k|v)$", r"\1.self_attn.\2"),
        (_BLOCK + r"attn1\.to_out\.0$", r"\1.self_attn.o"),
        (_BLOCK + r"attn2\.to_(q|k|v)$", r"\1.cross_attn.\2"),
        (_BLOCK + r"attn2\.to_out\.0$", r"\1.cross_attn.o"),
        (_BLOCK + r"attn2\.add_(k|v)_proj$", r"\1.cross_attn.\2_img"),
        (_BLOCK + r"ffn\.net\.0\.proj$", r"\1.ffn.0"),
        (_BLOCK + r"ffn\.net\.2$", r"\1.ffn.2"),
    ),
)


def lora_pairs(state: Mapping[str, torch.Tensor]) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """(component, module) -> (down, up) of a diffusers-format LoRA file; refuses any other tensor."""
    pairs: dict[tuple[str, str], list] = {}
    for key, value in state.items():
        for spelling, (down, up) in enumerate(_DOWN_UP):
            side = 0 if key.endswith(down) else 1 if key.endswith(up) else None
            if side is not None:
                component, _, module = key.removesuffix(_DOWN_UP[spelling][side]).partition(".")
                pairs.setdefault((component, module), [None, None])[side] = value
                break
        else:
            raise UnconvertibleLora(f"tensor {key!r} is not a LoRA down/up weight (DoRA and biases are not exported)")
    incomplete = [f"{c}.{m}" for (c, m), pair in pairs.items() if None in pair]
    if incomplete:
        raise UnconvertibleLora(f"{incomplete[0]} has a LoRA down or up weight without the other")
    return {name: (pair[0], pair[1]) for name, pair in pairs.items()}


def lora_alphas(metadata: Mapping[str, str] | None, components: set[str]) -> dict[str, float]:
    """Each component's alpha, from the PEFT config diffusers keeps in the file's metadata."""
    try:
        config = json.loads((metadata or {})["lora_adapter_metadata"])
    except (KeyError, ValueError):
        raise UnconvertibleLora("the file's metadata has no LoRA config (lora_adapter_metadata): its alpha is unknown")
    alphas = {}
    for component in components:
        if config.get(f"{component}.alpha_pattern") or config.get(f"{component}.rank_pattern"):
            raise UnconvertibleLora(f"{component}: per-module ranks or alphas are not exported")
        alpha = config.get(f"{component}.lora_alpha")
        if alpha is None:
            raise UnconvertibleLora(f"the file's LoRA config has no {component}.lora_alpha")
        alphas[component] = float(alpha)
    return alphas


def to_convention(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None,
                  convention: LoraKeyConvention, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The diffusers-format LoRA `state` (with its file's metadata) under `convention`'s names, in `dtype`.
    Tools scale each pair by alpha / rank, as PEFT does: the same alpha gives the same update."""
    import torch

    pairs = lora_pairs(state)
    alphas = lora_alphas(metadata, {component for component, _ in pairs})
    converted = {}
    for (component, module), (down, up) in sorted(pairs.items()):
        name = convention.key(component, module)
        converted[name + KOHYA_DOWN] = down.to(dtype).contiguous()
        converted[name + KOHYA_UP] = up.to(dtype).contiguous()
        converted[name + KOHYA_ALPHA] = torch.tensor(alphas[component], dtype=dtype)
    return converted
