"""Calibrate the rows' fit profiles from the meta-device estimator: `python -m kubetune_trainer.planning.profiles [FAMILY...]`.

For each family's reference architecture: parameter counts from the models the planner builds,
and the activations plus backward working memory measured at three points, solved for
per_step + batch * (per_sample + per_pixel * resolution**2). Prints each family's
`profile=FamilyProfile(...)` to paste into its row in api/src/kubetune_api/families.py.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kubetune_api.families import FAMILIES, Dynamic, FamilyProfile
from kubetune_api.spec import LAYOUTS_BY_FAMILY, TrainingJobSpec
from kubetune_trainer.planning.estimate import Planner
from kubetune_trainer.planning.models import load_models
from kubetune_trainer.planning.sharding import shard_units
from kubetune_trainer.models.reference_models import write_config_only

LOW, HIGH = 512, 1024          # the resolutions the diffusion families are calibrated at
# A family without a native resolution (the classifier) trains at its model's own size only: its
# profile is calibrated there at two batch sizes and scales with pixels through the batch.
OWN_SIZE_BATCHES = (8, 16)


def spec_for(family: str, folder: Path, resolution: int | None, batch: int = 1, adapter: str = "lora",
             checkpointing: bool = False) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "model": {"family": family, "pretrained": str(folder)},
        # A family training parts of its own (PMG) refuses a LoRA shape.
        "adapter": {"type": adapter, "rank": 8} if not FAMILIES[family].own_adapter else {},
        "data": {"layout": LAYOUTS_BY_FAMILY[family][0], "uri": "/data", "resolution": resolution},
        "training": {"maxSteps": 1, "batchSize": batch, "mixedPrecision": "bf16",
                     "gradientCheckpointing": checkpointing},
        "checkpoints": {"uri": "/ck"},
    })


def dynamic_bytes(planner: Planner, spec: TrainingJobSpec) -> int:
    activations = planner.activations(spec)
    return activations.saved + 2 * activations.largest + activations.recompute


def solve(planner: Planner, family: str, folder: Path, adapter: str, checkpointing: bool,
          own_size: int | None = None) -> Dynamic:
    """own_size: the model's own image size, where the family trains at nothing else."""
    def measured(resolution: int, batch: int) -> int:
        return dynamic_bytes(planner, spec_for(family, folder, resolution, batch, adapter, checkpointing))

    if own_size:
        few, many = OWN_SIZE_BATCHES
        one, two = measured(own_size, few), measured(own_size, many)
        per_sample = (two - one) / (many - few)
        return Dynamic(per_step=one - few * per_sample, per_sample=0.0, per_pixel=per_sample / own_size**2)
    low, high, two = measured(LOW, 1), measured(HIGH, 1), measured(LOW, 2)
    per_pixel = (high - low) / (HIGH**2 - LOW**2)
    per_sample = two - low - per_pixel * LOW**2
    return Dynamic(per_step=low - per_sample - per_pixel * LOW**2, per_sample=per_sample, per_pixel=per_pixel)


def parameters(module, trained_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trained_only)


def profile(family: str, folder: Path, planner: Planner) -> FamilyProfile:
    own_adapter = FAMILIES[family].own_adapter
    # A family training its own parts refuses adapter.type full: its "full" is its LoRA-shaped load.
    full = load_models(spec_for(family, folder, LOW, adapter="lora" if own_adapter else "full"))
    lora = load_models(spec_for(family, folder, LOW))
    base_name = full.quantized or full.trained
    base = full.components[base_name]
    import torch

    linear = sum(m.weight.numel() for m in base.modules() if type(m) is torch.nn.Linear)
    frozen = sum(parameters(m) for name, m in full.components.items() if name not in (base_name, lora.trained))
    # What a LoRA job trains: LoRA weights (per unit of rank: the specs' rank is 8) and the rest, whole
    # (PMG's own adapter; the classifier's new head, which PEFT trains beside its LoRA).
    trained = {name: p.numel() for name, p in lora.trained_module.named_parameters() if p.requires_grad}
    lora_per_rank = sum(n for name, n in trained.items() if "lora_" in name) // 8
    adapter = sum(n for name, n in trained.items() if "lora_" not in name)
    units = shard_units(full.trained_module) or [full.trained_module]
    own_size = None if FAMILIES[family].native_resolution else base.config.image_size
    adapters = ("lora",) if own_adapter else ("lora", "full")
    dynamic = {(kind, checkpointing): solve(planner, family, folder, kind, checkpointing, own_size)
               for kind in adapters for checkpointing in (False, True)}
    if own_adapter:  # it trains its own parts whatever spec.adapter says
        dynamic.update({("full", c): dynamic[("lora", c)] for c in (False, True)})
    return FamilyProfile(
        trained_module=parameters(base), linear_weights=linear, frozen=frozen, lora_per_rank=lora_per_rank,
        adapter=adapter, largest_unit=max(parameters(unit) for unit in units),
        loads_fp32=next(lora.components[base_name].parameters()).dtype == torch.float32, dynamic=dynamic,
        image_size=own_size,
    )


def literal(profile: FamilyProfile) -> str:
    """`profile=FamilyProfile(...)` as it is written in the family's row (kubetune_api.families)."""
    pad = " " * 19
    image_size = f" image_size={profile.image_size}," if profile.image_size else ""
    lines = ["profile=FamilyProfile(",
             f"{pad}trained_module={profile.trained_module:_}, linear_weights={profile.linear_weights:_}, "
             f"frozen={profile.frozen:_},",
             f"{pad}lora_per_rank={profile.lora_per_rank:_}, adapter={profile.adapter:_}, "
             f"largest_unit={profile.largest_unit:_}, loads_fp32={profile.loads_fp32},{image_size}"]
    for i, ((kind, checkpointing), d) in enumerate(profile.dynamic.items()):
        lines.append(f"{pad}dynamic={{" if i == 0 else pad + " " * 9)
        lines[-1] += (f'("{kind}", {checkpointing}): Dynamic({d.per_step:.4g}, {d.per_sample:.4g}, {d.per_pixel:.4g})'
                      + ("})" if i == len(profile.dynamic) - 1 else ","))
    return "\n".join(lines)


def main() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    families = sys.argv[1:] or list(LAYOUTS_BY_FAMILY)
    planner = Planner("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            print(f"{family}:\n" + literal(profile(family, write_config_only(family, Path(tmp) / family), planner)))


if __name__ == "__main__":
    main()
