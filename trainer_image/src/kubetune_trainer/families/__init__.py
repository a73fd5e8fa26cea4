"""Model families: each knows how to load its models, turn a batch into a loss and save its weights."""
from __future__ import annotations

from kubetune_trainer.families.base import ModelFamily
from kubetune_trainer.errors import ConfigError


def family_for(name: str) -> type[ModelFamily]:
    """The family class for `spec.model.family`."""
    if name == "sd15":
        from kubetune_trainer.families.sd15 import StableDiffusion15

        return StableDiffusion15
    raise ConfigError(
        f"spec.model.family: {name!r} is accepted by the API but not trained yet by this trainer "
        f"version; available: sd15"
    )
