"""FSDP's units: the blocks it gathers one at a time, found by the trainer's rule."""
from __future__ import annotations

import torch


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose class the model lists in `_no_split_modules` (diffusers and transformers both
    declare their transformer and resnet blocks there): the units the trainer's FSDP shards."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    return [sub for sub in module.modules() if type(sub).__name__ in names and sub is not module]


def largest_unit(module: torch.nn.Module, compute_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the largest unit gathered in the compute dtype, its trained parameter count).

    Without units the whole module is one (FSDP then gathers everything at once).
    """
    units = shard_units(module) or [module]
    element = torch.empty((), dtype=compute_dtype).element_size()
    best = max(units, key=lambda unit: sum(p.numel() for p in unit.parameters()))
    return (sum(p.numel() for p in best.parameters()) * element,
            sum(p.numel() for p in best.parameters() if p.requires_grad))
