"""What a family trains and how its trained weights are written: one way for every family.

A family makes its `Trainable` once, in __init__, with the function for its kind of model:
`diffusers_denoiser` (a UNet or DiT, whole or LoRA), `transformers_classifier` (a transformers model,
whole or a PEFT LoRA with its head trained whole) or, for parts of its own (PMG's adapter), a
`Trainable` with its own writer. The training loop, keep-best validation and the planner then use
the Trainable and never ask which family it came from. peft and diffusers are imported inside the
functions, so the planner imports this module without loading them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from kubetune_api.spec_model import AdapterSpec
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS, LORA_FILE, attach_lora, load_lora_init, lora_layers

# Attention projections of ViT-style encoders; set spec.adapter.targetModules for other models.
TRANSFORMERS_ATTENTION_TARGETS = ["q_proj", "v_proj", "query", "value"]  # transformers 5 names, then older ones

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Trainable:
    """The module whose trainable parameters train (DDP wraps it, FSDP shards it) and its writer."""

    module: torch.nn.Module
    # Writes `trained` (every trained parameter whole, on the CPU, by its name in `module`) into an
    # existing folder in the family's standard format; returns the files written.
    write: Callable[[Path, Weights], list[Path]]
    # Small enough (an adapter, not a whole model) to be written ready to pull into every checkpoint.
    publishable: bool
    # The counterpart of `write`: loads what it wrote in a folder into `module` (generation, evaluation).
    read: Callable[[Path], None] | None = None

    def save(self, out_dir: Path, trained: Weights) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        return self.write(out_dir, trained)

    def load(self, folder: Path) -> None:
        """Put the weights `save` wrote in `folder` (a checkpoint's or the run's final ones) into the module."""
        if self.read is None:
            raise ValueError(f"{type(self.module).__name__}: no reader for its saved weights")
        self.read(folder)


def diffusers_denoiser(model: torch.nn.Module, adapter: AdapterSpec, prefix: str, pipeline: str | None,
                       load_init: bool = True, exclude: Sequence[str] = (),
                       targets: list[str] | None = None) -> Trainable:
    """A diffusers UNet or DiT trained whole, or as a LoRA (fp32 weights) on its attention projections
    started from spec.adapter.initFrom when given (unless load_init=False: the planner's meta models).

    prefix: the pipeline's name for the model ("unet", "transformer"): the LoRA file's key prefix
    and a whole model's folder. pipeline: the diffusers pipeline class whose LoRA loader reads the
    file (None only where nothing is saved). exclude: modules (full names) that get no LoRA. targets:
    the family's default LoRA targets where the usual attention names (DIFFUSERS_ATTENTION_TARGETS) miss
    some of its attention (FLUX.2's fused single-stream blocks); spec.adapter.targetModules overrides either."""
    if adapter.type == "full":
        model.requires_grad_(True)
        return Trainable(model, partial(_write_diffusers_model, model, prefix), publishable=False,
                         read=partial(_read_diffusers_model, model, prefix))
    attach_lora(model, adapter, targets or DIFFUSERS_ATTENTION_TARGETS, exclude)
    if adapter.init_from and load_init:
        load_lora_init(model, adapter.init_from, prefix)
    return Trainable(model, partial(_write_diffusers_lora, model, prefix, pipeline), publishable=True,
                     read=lambda folder: load_lora_init(model, str(folder), prefix))


def transformers_classifier(model: torch.nn.Module, adapter: AdapterSpec) -> Trainable:
    """A transformers model trained whole, or wrapped as a PEFT LoRA whose new classification head
    trains whole (it starts random). Saved with save_pretrained: a model folder, or an adapter folder
    (`model.load_adapter(out_dir)`)."""
    if adapter.type == "full":
        model.requires_grad_(True)
        return Trainable(model, partial(_write_transformers_model, model), publishable=False,
                         read=partial(_read_transformers_model, model))
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(
        r=adapter.rank, lora_alpha=adapter.alpha or adapter.rank, lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules or TRANSFORMERS_ATTENTION_TARGETS,
        modules_to_save=[classification_head(model)],
    ))
    return Trainable(wrapped, partial(_write_transformers_adapter, wrapped), publishable=True,
                     read=partial(_read_transformers_adapter, wrapped))


def enable_gradient_checkpointing(module: torch.nn.Module) -> None:
    """Recompute the module's activations in the backward pass, through its library's switch."""
    if hasattr(module, "enable_gradient_checkpointing"):  # diffusers
        module.enable_gradient_checkpointing()
    elif hasattr(module, "gradient_checkpointing_enable"):  # transformers
        module.gradient_checkpointing_enable()
    else:
        raise ConfigError(f"spec.training.gradientCheckpointing: {type(module).__name__} does not support it")


def classification_head(model: torch.nn.Module) -> str:
    for name in ("classifier", "score", "head", "fc"):
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise ValueError(f"{type(model).__name__}: no classification head found to train with LoRA")


def whole_state(module: torch.nn.Module, trained: Weights) -> Weights:
    """A full fine-tune's state dict: the trained parameters plus the module's buffers."""
    from torch.distributed.tensor import DTensor

    state = {name: value for name, value in module.state_dict().items() if not isinstance(value, DTensor)}
    state.update(trained)
    missing = sorted(set(module.state_dict()) - set(state))
    if missing:
        raise RuntimeError(f"cannot save {type(module).__name__} whole: {missing[:3]} are neither trained nor local")
    return {name: value.detach().cpu().contiguous() for name, value in state.items()}


def _write_diffusers_model(module: torch.nn.Module, prefix: str, out_dir: Path, trained: Weights) -> list[Path]:
    """A fully fine-tuned diffusers model in its from_pretrained layout (config + safetensors) under <prefix>/."""
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    folder = out_dir / prefix
    folder.mkdir(parents=True, exist_ok=True)
    module.save_config(folder)
    save_file(whole_state(module, trained), folder / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
    return sorted(folder.iterdir())


def _write_diffusers_lora(module: torch.nn.Module, prefix: str, pipeline: str | None, out_dir: Path,
                          trained: Weights) -> list[Path]:
    """The LoRA file the pipeline's load_lora_weights reads (keys `<prefix>.…`, with the adapter's config)."""
    import diffusers

    if pipeline is None:
        raise ValueError("a LoRA made without its pipeline class cannot be saved")
    getattr(diffusers, pipeline).save_lora_weights(
        out_dir, safe_serialization=True, **{
            f"{prefix}_lora_layers": lora_layers(module, trained),
            f"{prefix}_lora_adapter_metadata": module.peft_config["default"].to_dict(),
        })
    return [out_dir / LORA_FILE]


def _write_transformers_model(model: torch.nn.Module, out_dir: Path, trained: Weights) -> list[Path]:
    return _save_pretrained(model, out_dir, whole_state(model, trained))


def _write_transformers_adapter(model: torch.nn.Module, out_dir: Path, trained: Weights) -> list[Path]:
    return _save_pretrained(model, out_dir, trained)


def _save_pretrained(model: torch.nn.Module, out_dir: Path, state: Weights) -> list[Path]:
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    return sorted(p for p in out_dir.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))


def _read_diffusers_model(module: torch.nn.Module, prefix: str, folder: Path) -> None:
    """What _write_diffusers_model wrote under <prefix>/, into the loaded model."""
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    module.load_state_dict(load_file(folder / prefix / SAFETENSORS_WEIGHTS_NAME))


def _read_transformers_model(model: torch.nn.Module, folder: Path) -> None:
    """What save_pretrained wrote, read by from_pretrained (transformers renames some keys on the way
    out and back in), copied into the loaded model."""
    saved = type(model).from_pretrained(folder, dtype=next(model.parameters()).dtype)
    model.load_state_dict(saved.state_dict())


def _read_transformers_adapter(model: torch.nn.Module, folder: Path) -> None:
    """The PEFT adapter folder save_pretrained wrote, head included, into the wrapped model."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
