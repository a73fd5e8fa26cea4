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
class Stack:
    """Modules diffusers keeps apart that the tools' model fuses into one Linear (FLUX's q, k and v: one
    `qkv`), so the tools read one LoRA pair for all of them: the parts' down weights stacked, their up
    weights block-diagonal (each part's update stays its own, and diffusers' converter splits such a
    pair back exactly: its "sparse" case), and a part the run did not adapt a zero block."""

    parts: tuple[str, ...]   # a regular expression over the diffusers module path per part, in the fused order
    name: str                # the fused module's name: a replacement for any part's expression
    widths: tuple[int, ...]  # each part's output width, in multiples of the first part's

    def match(self, module: str) -> tuple[int, str] | None:
        """(the part `module` is, the fused module's name), or None."""
        for index, pattern in enumerate(self.parts):
            name, found = re.subn(pattern, self.name, module)
            if found:
                return index, name
        return None

    def fuse(self, parts: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(down [n·r, in], up [Σ widths, n·r]) of the given parts' (down [r, in], up [out, r])."""
        import torch

        rank, inputs = next(iter(parts.values()))[0].shape
        index, (_, up) = next(iter(parts.items()))
        unit = up.shape[0] // self.widths[index]
        fused_down = torch.zeros(len(self.parts) * rank, inputs, dtype=up.dtype)
        fused_up = torch.zeros(sum(self.widths) * unit, len(self.parts) * rank, dtype=up.dtype)
        row = 0
        for index, width in enumerate(self.widths):
            if index in parts:
                down, up = parts[index]
                if down.shape != (rank, inputs) or up.shape != (width * unit, rank):
                    raise UnconvertibleLora(f"the parts of {self.name} differ in rank or shape")
                fused_down[index * rank:(index + 1) * rank] = down
                fused_up[row:row + width * unit, index * rank:(index + 1) * rank] = up
            row += width * unit
        return fused_down, fused_up


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
    stacks: tuple[Stack, ...] = ()  # modules the tools hold fused (FLUX's qkv), named by the Stack

    def stacked(self, module: str) -> tuple[Stack, int, str] | None:
        """(its stack, its part, the fused module's name) of a module the tools hold fused, or None."""
        for stack in self.stacks:
            found = stack.match(module)
            if found is not None:
                return stack, *found
        return None

    def prefix(self, component: str) -> str:
        if component not in self.prefixes:
            raise UnconvertibleLora(f"the {self.name} convention has no name for LoRA weights of {component!r} "
                                    f"(it names {', '.join(self.prefixes)})")
        return self.prefixes[component]

    def key(self, component: str, module: str) -> str:
        prefix = self.prefix(component)
        module = self.original_name(module)
        return prefix + (module.replace(".", "_") if self.flat else module)

    def original_name(self, module: str) -> str:
        for pattern, replacement in self.renames:
            renamed, found = re.subn(pattern, replacement, module)
            if found:
                return renamed
        if self.renames or self.stacks:
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


# BFL's FLUX checkpoint names under kohya's `lora_unet_` (what kohya sd-scripts' FLUX LoRA, ComfyUI and
# diffusers' _convert_kohya_flux_lora_to_diffusers / _convert_kohya_flux2_lora_to_diffusers read). FLUX.1
# and FLUX.2 share a double-stream block's img_/txt_ attention (q, k and v fused in one qkv per stream),
# its projections and MLPs, the image and text inputs and the timestep embedder; the rest is each one's.
_DOUBLE, _SINGLE = r"^transformer_blocks\.(\d+)\.", r"^single_transformer_blocks\.(\d+)\."


def _fused(block: str, names: tuple[str, ...], fused: str, widths: tuple[int, ...] = (1, 1, 1)) -> Stack:
    return Stack(tuple(block + name + "$" for name in names), fused, widths)


def _bfl_kohya(name: str, read_by: str, *, mlp: tuple[str, str], embedders: tuple[str, Mapping[str, str]],
               renames: tuple[tuple[str, str], ...], stacks: tuple[Stack, ...] = ()) -> LoraKeyConvention:
    """kohya's names for a FLUX-style transformer. mlp: diffusers' names of a double-stream MLP's input and
    output layers (under ff. and ff_context.); embedders: (diffusers' module holding the embedders, diffusers'
    embedder -> BFL's), each embedder's linear_1 / linear_2 being BFL's <name>_in_in_layer / <name>_in_out_layer;
    renames and stacks: the model's own modules beyond what FLUX.1 and FLUX.2 share."""
    holder, bfl_embedders = embedders
    return LoraKeyConvention(
        name=name,
        read_by=read_by,
        prefixes={"transformer": "lora_unet_"},
        flat=True,
        renames=(
            (_DOUBLE + r"attn\.to_out\.0$", r"double_blocks_\1_img_attn_proj"),
            (_DOUBLE + r"attn\.to_add_out$", r"double_blocks_\1_txt_attn_proj"),
            *((_DOUBLE + re.escape(f"{ff}.{layer}") + "$", rf"double_blocks_\1_{stream}_mlp_{index}")
              for ff, stream in (("ff", "img"), ("ff_context", "txt")) for layer, index in zip(mlp, (0, 2))),
            (r"^x_embedder$", "img_in"), (r"^context_embedder$", "txt_in"),
            *((f"^{re.escape(f'{holder}.{embedder}.linear_{n}')}$", f"{bfl}_in_{side}_layer")
              for embedder, bfl in bfl_embedders.items() for n, side in ((1, "in"), (2, "out"))),
            *renames,
        ),
        stacks=(
            _fused(_DOUBLE, (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v"), r"double_blocks_\1_img_attn_qkv"),
            _fused(_DOUBLE, (r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj"),
                   r"double_blocks_\1_txt_attn_qkv"),
            *stacks,
        ),
    )


# FLUX.1: a double-stream block's modulation per stream; a single-stream block's linear1 (q, k, v and the
# MLP's input, fused), linear2 and modulation; the guidance and pooled-text (vector) embedders. The final
# layer is not named: diffusers 0.42.1 reads its kohya pair without the alpha.
FLUX_KOHYA = _bfl_kohya(
    "kohya FLUX (lora_unet_ with BFL's module names)",
    "ComfyUI, kohya sd-scripts, diffusers load_lora_weights",
    mlp=("net.0.proj", "net.2"),
    embedders=("time_text_embed", {"timestep_embedder": "time", "guidance_embedder": "guidance",
                                   "text_embedder": "vector"}),
    renames=(
        (_DOUBLE + r"norm1\.linear$", r"double_blocks_\1_img_mod_lin"),
        (_DOUBLE + r"norm1_context\.linear$", r"double_blocks_\1_txt_mod_lin"),
        (_SINGLE + r"proj_out$", r"single_blocks_\1_linear2"),
        (_SINGLE + r"norm\.linear$", r"single_blocks_\1_modulation_lin"),
    ),
    # FLUX.1's MLP is 4x the width: diffusers splits linear1 at [3072, 3072, 3072, 12288] (FLUX.1's sizes).
    stacks=(_fused(_SINGLE, (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"proj_mlp"), r"single_blocks_\1_linear1",
                   (1, 1, 1, 4)),),
)

# FLUX.2 (and klein): its MLPs are linear_in / linear_out, and a single-stream block already fuses q, k, v
# and the MLP's input (to_qkv_mlp_proj = linear1) and both outputs (attn.to_out = linear2) as BFL's does;
# its modulation is shared by all blocks, and its final layer is named.
FLUX2_KOHYA = _bfl_kohya(
    "kohya FLUX.2 (lora_unet_ with BFL's module names)",
    "ComfyUI, diffusers load_lora_weights",
    mlp=("linear_in", "linear_out"),
    embedders=("time_guidance_embed", {"timestep_embedder": "time"}),
    renames=(
        (_SINGLE + r"attn\.to_qkv_mlp_proj$", r"single_blocks_\1_linear1"),
        (_SINGLE + r"attn\.to_out$", r"single_blocks_\1_linear2"),
        (r"^proj_out$", "final_layer_linear"),
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
    converted, fused = {}, {}
    for (component, module), (down, up) in sorted(pairs.items()):
        stacked = convention.stacked(module)
        if stacked is not None:
            stack, part, name = stacked
            fused.setdefault((component, stack, name), {})[part] = (down, up)
            continue
        name = convention.key(component, module)
        converted[name + KOHYA_DOWN] = down.to(dtype).contiguous()
        converted[name + KOHYA_UP] = up.to(dtype).contiguous()
        converted[name + KOHYA_ALPHA] = torch.tensor(alphas[component], dtype=dtype)
    for (component, stack, module), parts in sorted(fused.items(), key=lambda item: item[0][2]):
        down, up = stack.fuse(parts)
        name = convention.prefix(component) + module
        converted[name + KOHYA_DOWN] = down.to(dtype).contiguous()
        converted[name + KOHYA_UP] = up.to(dtype).contiguous()
        # The tools scale by alpha over the fused rank (n·r): n·alpha keeps each part's alpha / r.
        converted[name + KOHYA_ALPHA] = torch.tensor(alphas[component] * len(stack.parts), dtype=dtype)
    return converted
