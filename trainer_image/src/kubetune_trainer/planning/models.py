"""The job's models on the meta device, built from the config files under spec.model.pretrained.

Only config.json files are read, never weights: each component of the family's reference
architecture (its DEFINITION: families.definition) is constructed from its config with
`torch.device("meta")`, in the dtype the family loads it in, and made trainable the way the
family does it (DEFINITION.make_trainable: families.trainable's functions, PMG's adapter), so
parameter counts and dtypes are the trainer's.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families import definition_for
from kubetune_trainer.models.model_folder import model_folder, read_model_config
from kubetune_trainer.families.components import Component

DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIG_HINT = ("kubetune plan reads the models' config files (no weights); write the standard ones with "
               "`kubetune dev tiny-model --family {family} --full-size --config-only --out DIR`")


@dataclass
class JobModels:
    """Every model the trainer loads for the job, by name (its subfolder), all on the meta device."""

    components: dict[str, torch.nn.Module]
    trained: str              # the module DDP wraps / FSDP shards and whose trainable parameters train
    quantized: str | None     # the frozen denoiser spec.model.quantization applies to

    @property
    def trained_module(self) -> torch.nn.Module:
        return self.components[self.trained]


def weight_dtype(spec: TrainingJobSpec) -> torch.dtype:
    return DTYPES[spec.training.mixed_precision]


def local_folder(spec: TrainingJobSpec, uri: str, field: str) -> Path:
    """The local folder behind a pretrained URI, or a ConfigError saying why it cannot be read."""
    if "://" in uri:
        raise ConfigError(f"{field}: {uri} is not a local folder; {CONFIG_HINT.format(family=spec.model.family)}, "
                          "or copy only its *.json files here and point the manifest at them (--set)")
    path = model_folder(uri, field)
    if not path.is_dir():
        raise ConfigError(f"{field}: {uri} is not a local folder (a model-hub id cannot be read here); "
                          + CONFIG_HINT.format(family=spec.model.family))
    return path


def read_config(spec: TrainingJobSpec, folder: Path, field: str) -> dict:
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"{field}: {file} is missing; " + CONFIG_HINT.format(family=spec.model.family))
    return read_model_config(file)  # bounded before anything is built from it


def build_component(component: Component, folder: Path, config: dict, auto_class: str | None = None
                    ) -> torch.nn.Module:
    """The model of a config file on the meta device (fp32, as constructed)."""
    with torch.device("meta"):
        if component.library == "diffusers":
            import diffusers

            return getattr(diffusers, component.cls).from_config(config)
        import transformers

        config_object = transformers.AutoConfig.from_pretrained(folder)
        if auto_class:  # the trainer loads these through an Auto class: the config names the architecture
            return getattr(transformers, auto_class).from_config(config_object)
        return getattr(transformers, component.cls)(config_object)


@contextmanager
def _no_loading_advice():
    """diffusers advises on `.to(dtype)` about modules to keep in fp32 when loading weights; none are loaded here."""
    logger = logging.getLogger("diffusers.models.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_models(spec: TrainingJobSpec) -> JobModels:
    with _no_loading_advice():
        return _load_models(spec)


def _load_models(spec: TrainingJobSpec) -> JobModels:
    definition = definition_for(spec.model.family)
    root = local_folder(spec, spec.model.pretrained, "spec.model.pretrained")
    dtype = weight_dtype(spec)
    components: dict[str, torch.nn.Module] = {}
    for name, component in definition.architecture.items():
        folder, field = root / component.subfolder, "spec.model.pretrained"
        if name in definition.elsewhere:  # a spec field may name another folder (spec.pmg.languageModel)
            other_field, value_in = definition.elsewhere[name]
            if value_in(spec):
                folder, field = local_folder(spec, value_in(spec), other_field), other_field
        config = read_config(spec, folder, field)
        model = build_component(component, folder, config, definition.auto_classes.get(name))
        components[name] = model.to(definition.load_dtype(spec, name, config, dtype)).eval()
    for model in components.values():  # frozen, then what the family trains is added
        model.requires_grad_(False)
    with torch.device("meta"):
        definition.make_trainable(spec, components)
    return JobModels(components, definition.trained, definition.quantized)
