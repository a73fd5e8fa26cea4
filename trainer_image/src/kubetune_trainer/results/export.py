"""A run's trained weights in the form another tool loads (`kubetune export`): each function reads the
weights as the trainer wrote them (a run's root or a checkpoint folder, pulled to this machine) and
writes a new folder; the CLI checks the request, and moves the folder where the user asked.

- diffusers: the files as saved (the LoRA load_lora_weights reads, Wan's second expert's, PMG's
  adapter, a classifier's model or adapter), floating-point tensors in the asked dtype, metadata kept.
- kohya: the LoRA under the key names of the family's non-diffusers tools (lora_keys).
- merged: the LoRA fused into the base model: a whole diffusers pipeline folder (from_pretrained).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from kubetune_trainer.families.definition import FamilyDefinition
from kubetune_trainer.families.lora import LORA_FILE
from kubetune_trainer.results.lora_keys import LoraKeyConvention, to_convention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lora_files(definition: FamilyDefinition, weights: Path) -> dict[str, dict]:
    """The family's LoRA files present in `weights`, each with its load_lora_weights arguments."""
    known = {LORA_FILE: {}, **{name: dict(kwargs) for name, kwargs in definition.other_lora_files.items()}}
    return {name: kwargs for name, kwargs in known.items() if (weights / name).is_file()}


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as opened:
        return {key: opened.get_tensor(key) for key in opened.keys()}, opened.metadata() or {}


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors in `dtype`; integer ones (step counters, indices) as they are."""
    return {key: value.to(dtype).contiguous() if value.is_floating_point() else value for key, value in state.items()}


def write_diffusers(weights: Path, files: list[Path], out: Path, dtype: torch.dtype) -> list[Path]:
    """`files` (under `weights`) copied into `out`: safetensors in `dtype` with their metadata, the rest as is."""
    from safetensors.torch import save_file

    written = []
    for file in files:
        target = out / file.relative_to(weights)
        target.parent.mkdir(parents=True, exist_ok=True)
        if file.suffix == ".safetensors":
            state, metadata = read_safetensors(file)
            save_file(cast(state, dtype), target, metadata=metadata)
        else:
            shutil.copyfile(file, target)
        written.append(target)
    return written


def write_kohya(weights: Path, names: dict[str, str], convention: LoraKeyConvention, out: Path,
                dtype: torch.dtype, provenance: dict[str, str]) -> list[Path]:
    """Each LoRA file of `weights` (name -> the exported file's name) under `convention`'s keys, with the
    metadata kohya-based tools show (rank, alpha) and where it came from."""
    from safetensors.torch import save_file

    written = []
    for source, target in names.items():
        state, metadata = read_safetensors(weights / source)
        converted = to_convention(state, metadata, convention, dtype)
        ranks = {value.shape[0] for key, value in converted.items() if key.endswith(".lora_down.weight")}
        alphas = {value.item() for key, value in converted.items() if key.endswith(".alpha")}
        save_file(converted, out / target, metadata={
            "format": "pt", "ss_network_module": "networks.lora",
            "ss_network_dim": str(max(ranks)), "ss_network_alpha": str(max(alphas)),
            **{f"kubetune.{key}": value for key, value in provenance.items()},
            **{key: value for key, value in metadata.items() if key.startswith("kubetune.")},
        })
        written.append(out / target)
    return written


def load_pipeline(definition: FamilyDefinition, base: str, dtype: torch.dtype):
    """The family's diffusers pipeline from the base model folder (spec.model.pretrained), on the CPU."""
    import diffusers

    return getattr(diffusers, definition.pipeline).from_pretrained(base, dtype=dtype)


def write_merged(definition: FamilyDefinition, spec, weights: Path, out: Path, dtype: torch.dtype) -> list[Path]:
    """The base pipeline (spec.model.pretrained, with spec.model.vae in place of its own VAE when the run
    used another; `spec` names local paths) with every LoRA file of `weights` fused into its weights
    (or, from a full fine-tune, its trained components in place of the base's), saved whole in `dtype`.
    Fusing happens in fp32 (a low-precision base would round the small LoRA update away), then the
    pipeline is cast."""
    from kubetune_trainer.families.vae import vae_source

    pipeline = load_pipeline(definition, spec.model.pretrained, torch.float32)
    replaced = {folder.name: folder for folder in sorted(weights.iterdir()) if (folder / "config.json").is_file()}
    if spec.model.vae is not None:
        path, subfolder = vae_source(spec)
        pipeline.register_modules(vae=type(pipeline.vae).from_pretrained(path, subfolder=subfolder, dtype=torch.float32))
    for name, folder in replaced.items():
        trained = getattr(pipeline, name, None)
        if isinstance(trained, torch.nn.Module):
            pipeline.register_modules(**{name: type(trained).from_pretrained(folder, dtype=torch.float32)})
    adapters = []
    for index, (name, kwargs) in enumerate(lora_files(definition, weights).items()):
        adapter = f"export{index}"
        pipeline.load_lora_weights(str(weights), weight_name=name, adapter_name=adapter, **kwargs)
        adapters.append(adapter)
    if adapters:
        # fuse_lora fuses into the components it is told (Wan's default: transformer alone, not transformer_2).
        pipeline.fuse_lora(components=adapted_components(pipeline), adapter_names=adapters, lora_scale=1.0)
        pipeline.unload_lora_weights()
    pipeline.to(dtype)
    pipeline.save_pretrained(out, safe_serialization=True)
    return sorted(p for p in out.rglob("*") if p.is_file())


def adapted_components(pipeline) -> list[str]:
    """The pipeline components its LoRA loader may adapt (diffusers' _lora_loadable_modules) that hold a LoRA now."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name in pipeline._lora_loadable_modules
            if isinstance(getattr(pipeline, name, None), torch.nn.Module)
            and any(isinstance(module, BaseTunerLayer) for module in getattr(pipeline, name).modules())]
