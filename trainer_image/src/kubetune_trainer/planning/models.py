"""The job's models on the meta device, built from the config files under spec.model.pretrained.

Only config.json files are read, never weights: each model is constructed from its config with
`torch.device("meta")`, in the dtype the trainer loads it in, and made trainable the way the
family does it (families.trainable's functions, PMG's adapter), so parameter counts and dtypes are
the trainer's.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.reference_models import ARCHITECTURES, Component

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
    path = Path(uri)
    if not path.is_dir():
        raise ConfigError(f"{field}: {uri} is not a local folder (a model-hub id cannot be read here); "
                          + CONFIG_HINT.format(family=spec.model.family))
    return path


def read_config(spec: TrainingJobSpec, folder: Path, field: str) -> dict:
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"{field}: {file} is missing; " + CONFIG_HINT.format(family=spec.model.family))
    return json.loads(file.read_text())


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


# Components the trainer loads through an Auto class rather than a named one.
AUTO_CLASSES = {("classifier", "model"): "AutoModelForImageClassification",
                ("pmg", "language_model"): "AutoModelForCausalLM"}
TRAINED = {"sd15": "unet", "sdxl": "unet", "flux-kontext": "transformer", "qwen-image-edit": "transformer",
           "pmg": "adapter", "classifier": "model"}
# The frozen denoiser spec.model.quantization loads quantized (PMG's SD1.5 UNet is frozen too).
QUANTIZED = {"sd15": "unet", "sdxl": "unet", "flux-kontext": "transformer", "qwen-image-edit": "transformer",
             "pmg": "unet"}


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
    family = spec.model.family
    root = local_folder(spec, spec.model.pretrained, "spec.model.pretrained")
    dtype = weight_dtype(spec)
    components: dict[str, torch.nn.Module] = {}
    for name, component in ARCHITECTURES[family].items():
        folder, field = root / component.subfolder, "spec.model.pretrained"
        if name == "language_model" and spec.pmg and spec.pmg.language_model:
            folder, field = local_folder(spec, spec.pmg.language_model, "spec.pmg.languageModel"), "spec.pmg.languageModel"
        config = read_config(spec, folder, field)
        model = build_component(component, folder, config, AUTO_CLASSES.get((family, name)))
        components[name] = model.to(_load_dtype(spec, name, config, dtype)).eval()
    trained = TRAINED[family]
    _make_trainable(spec, components, trained)
    return JobModels(components, trained, QUANTIZED.get(family))


def _load_dtype(spec: TrainingJobSpec, name: str, config: dict, dtype: torch.dtype) -> torch.dtype:
    """The dtype each model loads in, as the families load them."""
    family = spec.model.family
    if family == "classifier":  # from_pretrained without a dtype: the config's, else the weights' (fp32)
        return getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    if name == TRAINED[family] and spec.adapter.type == "full":
        return torch.float32  # a fully trained denoiser stays fp32; autocast computes in low precision
    return dtype


def _make_trainable(spec: TrainingJobSpec, components: dict[str, torch.nn.Module], trained: str) -> None:
    """Freeze everything, then add what the family trains, with the families' own functions."""
    from kubetune_trainer.families import trainable

    for model in components.values():
        model.requires_grad_(False)
    family, adapter = spec.model.family, spec.adapter
    with torch.device("meta"):
        if family == "pmg":
            from kubetune_trainer.families.pmg import adapter_for

            components["adapter"] = adapter_for(spec.pmg_options, components["language_model"].config,
                                                components["unet"].config.cross_attention_dim)
        elif family == "classifier":
            components[trained] = trainable.transformers_classifier(components[trained], adapter).module
        else:  # nothing is saved from the meta model: no pipeline to save with, no initFrom to read
            trainable.diffusers_denoiser(components[trained], adapter, trained, pipeline=None, load_init=False)
