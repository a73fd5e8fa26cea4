"""Model families: each knows how to load its models, turn a batch into a loss and save its weights."""
from __future__ import annotations

from importlib import import_module

from kubetune_trainer.errors import ConfigError
from kubetune_trainer.families.base import ModelFamily

# spec.model.family -> module:class, imported on demand (each pulls in its own model classes).
FAMILIES = {
    "sd15": "kubetune_trainer.families.sd15:StableDiffusion15",
    "sdxl": "kubetune_trainer.families.sdxl:StableDiffusionXL",
    "flux-kontext": "kubetune_trainer.families.flux_kontext:FluxKontext",
    "qwen-image-edit": "kubetune_trainer.families.qwen_image_edit:QwenImageEdit",
    "pmg": "kubetune_trainer.families.pmg:PersonalizedGeneration",
    "classifier": "kubetune_trainer.families.classifier:ImageClassifier",
}


def family_for(name: str) -> type[ModelFamily]:
    """The family class for `spec.model.family`."""
    if name not in FAMILIES:
        raise ConfigError(f"spec.model.family: unknown {name!r}; available: {', '.join(FAMILIES)}")
    module, cls = FAMILIES[name].split(":")
    try:
        return getattr(import_module(module), cls)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise ConfigError(f"spec.model.family: {name!r} is accepted by the API but not trained yet by "
                          "this trainer version") from None
