"""Reference architectures as folders: each family's published components (its DEFINITION.architecture,
made of kubetune_trainer.families.components) written as config-only folders.

Model hubs are out of reach on our machines, but an architecture is fully described by its
config.json. `kubetune plan` builds them on the meta device, benchmarks build them with random weights,
and a config-only folder (`kubetune dev tiny-model --full-size --config-only`) has the standard
diffusers/transformers layout with configs, scheduler and tokenizer stand-ins but no weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kubetune_api.families import FAMILIES
from kubetune_trainer.families import definition_for
from kubetune_trainer.families.components import Component, build, config_object


# --- config-only folders ----------------------------------------------------------------------

def _write_component_config(component: Component, out_dir: Path) -> None:
    folder = out_dir / component.subfolder
    folder.mkdir(parents=True, exist_ok=True)
    if component.library == "diffusers":
        with torch.device("meta"):  # the class fills in every default; nothing is allocated
            build(component).save_config(folder)
        return
    config = config_object(component)
    config.architectures = [component.cls]
    config.save_pretrained(folder)


def _write_model_index(definition, out_dir: Path) -> None:
    """model_index.json, as a pipeline's save_pretrained writes it (the pipeline itself would need weights)."""
    import diffusers

    scheduler = definition.scheduler()
    scheduler.save_pretrained(out_dir / "scheduler")
    index = {"_class_name": definition.pipeline, "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", type(scheduler).__name__]}
    for name, component in definition.architecture.items():
        if name not in definition.beside_pipeline:
            index[name] = [component.library, component.cls]
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3", "processor"):
        if (out_dir / name).is_dir():
            index[name] = ["transformers", _saved_class(out_dir / name)]
    index.update(definition.model_index)
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _saved_class(folder: Path) -> str:
    for name, key in (("processor_config.json", "processor_class"), ("tokenizer_config.json", "tokenizer_class")):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())[key]
    raise FileNotFoundError(f"{folder}: no tokenizer or processor config")


def architecture(family: str) -> dict[str, Component]:
    """The reference architecture the family's module declares (DEFINITION.architecture)."""
    return dict(_definition(family).architecture)


def _definition(family: str):
    if family not in FAMILIES:
        raise ValueError(f"no reference architecture for family {family!r}; available: {', '.join(FAMILIES)}")
    return definition_for(family)


def write_config_only(family: str, out_dir: Path) -> Path:
    """A folder in the family's standard layout with every config, and no weights: a diffusers
    pipeline's (with its scheduler, tokenizer stand-ins and model_index.json) or a transformers model's."""
    definition = _definition(family)
    out_dir.mkdir(parents=True, exist_ok=True)
    for component in definition.architecture.values():
        _write_component_config(component, out_dir)
    if definition.pipeline:
        if definition.write_tokenizers:
            definition.write_tokenizers(out_dir)
        _write_model_index(definition, out_dir)
    return out_dir

