"""LoRA on a diffusers denoiser: attach, read out in the diffusers format, start from existing weights."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from kubetune_api.spec_model import AdapterSpec
from kubetune_trainer.errors import ConfigError

LORA_FILE = "pytorch_lora_weights.safetensors"


# The attention projections every diffusers denoiser (UNet and DiT alike) names this way, and
# which the diffusers LoRA recipes adapt by default.
DIFFUSERS_ATTENTION_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def attach_lora(model: torch.nn.Module, adapter: AdapterSpec, default_targets: list[str],
                exclude: Sequence[str] = ()) -> None:
    """Freeze the model and add a LoRA adapter whose weights train in fp32; modules named in
    `exclude` (full names: ones whose output never reaches the loss) get none."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha or adapter.rank,
        lora_dropout=adapter.dropout,
        init_lora_weights="gaussian",
        target_modules=adapter.target_modules or default_targets,
        **({"exclude_modules": list(exclude)} if exclude else {}),  # the saved config as before when none
    ))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()


def lora_layers(model: torch.nn.Module, trained: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's weights under the diffusers names `save_lora_weights` expects: from `trained`
    (whole tensors by parameter name, e.g. gathered from shards) or else the model's own.

    diffusers renames the usual attention projections (to_q, to_k, to_v, to_out.0) to its older
    `lora.down`/`lora.up` keys and no others; its loaders read a file's first key to decide the
    format of all. Where some adapted module has no older name (FLUX.2's to_qkv_mlp_proj, a
    targetModules beyond attention), every key stays in the PEFT form, else those would not load."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    weights = get_peft_model_state_dict(model, state_dict=trained)
    renamed = convert_state_dict_to_diffusers(weights)
    return weights if any(".lora_A." in key or ".lora_B." in key for key in renamed) else renamed


def load_lora_init(model: torch.nn.Module, source: str, prefix: str) -> None:
    """Copy saved LoRA weights (diffusers format, keys `<prefix>.<module>.lora_A.weight`) into the
    freshly attached adapter; refuse, naming what differs, unless rank and targets match exactly."""
    path = Path(source)
    file = path / LORA_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"spec.adapter.initFrom: {file} does not exist")
    saved = {key.removeprefix(f"{prefix}."): value for key, value in load_file(file).items()
             if key.startswith(f"{prefix}.")}
    current = lora_layers(model)
    missing, unexpected = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
    if missing or unexpected:
        raise ConfigError(
            f"spec.adapter.initFrom: {file} adapts other modules than spec.adapter.targetModules "
            f"({len(missing)} missing, e.g. {missing[:1]}; {len(unexpected)} unexpected, e.g. {unexpected[:1]})"
        )
    for key, value in saved.items():
        if value.shape != current[key].shape:
            raise ConfigError(f"spec.adapter.initFrom: {file} has LoRA rank {_rank(key, value)} but "
                              f"spec.adapter.rank is {_rank(key, current[key])} ({key})")
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, convert_unet_state_dict_to_peft(saved), adapter_name="default")
    unexpected_keys = getattr(result, "unexpected_keys", None)
    if unexpected_keys:
        raise ConfigError(f"spec.adapter.initFrom: weights the adapter does not have: {unexpected_keys[:2]}")


def _rank(key: str, weight: torch.Tensor) -> int:
    """The down (A) projection is (rank, in), the up (B) one (out, rank)."""
    return weight.shape[0] if ".lora_A." in key or ".lora.down." in key else weight.shape[1]
