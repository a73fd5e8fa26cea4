"""Model families: each knows how to load its models, turn a batch into a loss and save its weights.

The registry is derived, not kept: spec.model.family NAME (a row of kubetune_api.families) is
trained by the module kubetune_trainer.families.<NAME with "-" as "_">, whose DEFINITION
(families.definition.FamilyDefinition) names its ModelFamily class and everything else the trainer
derives from it. Modules are imported on demand (each pulls in its own model classes).
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from kubetune_api.families import FAMILIES
from kubetune_trainer.errors import ConfigError

if TYPE_CHECKING:
    from kubetune_trainer.families.base import ModelFamily
    from kubetune_trainer.families.definition import FamilyDefinition


def module_name(family: str) -> str:
    """The trainer module of a family of the table: its name with "-" as "_" (flux-kontext: flux_kontext)."""
    return f"{__name__}.{family.replace('-', '_')}"


def definition_for(name: str) -> FamilyDefinition:
    """The DEFINITION of family `name` (spec.model.family)."""
    if name not in FAMILIES:
        raise ConfigError(f"spec.model.family: unknown {name!r}; available: {', '.join(FAMILIES)}")
    module = module_name(name)
    try:
        return import_module(module).DEFINITION
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise ConfigError(f"spec.model.family: {name!r} is accepted by the API but not trained yet by "
                          "this trainer version") from None


def family_for(name: str) -> type[ModelFamily]:
    """The family class for `spec.model.family`."""
    return definition_for(name).family


def definitions() -> dict[str, FamilyDefinition]:
    """Every family's DEFINITION, in table order (imports every family module)."""
    return {name: definition_for(name) for name in FAMILIES}
