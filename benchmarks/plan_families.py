"""`kubetune plan` at each family's real architecture: 1024 px (the classifier: its own size),
LoRA r16 (PMG: its own adapter), batch 1, bf16, one GPU of 80 GB; with and without gradient
checkpointing, with and without an fp8 base (where the family takes one), and with a filled
embedding cache (its frozen encoders in CPU memory, spec.model.encoderDevice auto).

    .venv/bin/python benchmarks/plan_families.py [FAMILY ...]

Builds every model on the meta device from the reference configs (no weights): seconds per family.
Prints one table row per family and setting; the figures go into benchmarks/RESULTS.md.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kubetune_api.families import FAMILIES, LORA_ALPHA, LORA_RANK, QUANTIZATION
from kubetune_api.manifest import parse_manifest

GIB = 2**30
CAPACITY = 80 * 10**9  # an "80 GB" GPU


def job(family: str, folder: Path, checkpointing: bool, fp8: bool, cached: bool) -> dict:
    info = FAMILIES[family]
    lora = {"rank": 16} if LORA_RANK in info.honours else {}
    lora.update({"alpha": 16} if LORA_ALPHA in info.honours else {})
    return {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "plan"}, "spec": {
        "model": {"family": family, "pretrained": str(folder), **({"quantization": "fp8"} if fp8 else {})},
        "adapter": {"type": "lora", **lora},
        "data": {"layout": info.layouts[0], "uri": "/data", "cache": {"enabled": cached},
                 **({"resolution": 1024} if info.native_resolution else {})},
        "training": {"maxSteps": 1, "batchSize": 1, "mixedPrecision": "bf16",
                     "gradientCheckpointing": checkpointing},
        "checkpoints": {"uri": "/ck"},
    }}


def main(argv: list[str]) -> None:
    from kubetune_trainer.planning import plan_job
    from kubetune_trainer.planning.estimate import Planner
    from kubetune_trainer.models.reference_models import write_config_only

    families = argv or list(FAMILIES)
    print("| family | setting | weights GiB | total GiB | fits 80 GB |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            folder = write_config_only(family, Path(tmp) / family)
            planner = Planner("cuda")
            settings = [(False, False, False), (True, False, False)]
            if QUANTIZATION in FAMILIES[family].honours:
                settings += [(False, True, False), (True, True, False)]
            settings.append((True, QUANTIZATION in FAMILIES[family].honours, True))
            for checkpointing, fp8, cached in settings:
                spec = parse_manifest(job(family, folder, checkpointing, fp8, cached)).spec
                plan = plan_job(spec, CAPACITY, world_size=1, device="cuda", planner=planner)
                e = plan.estimate
                setting = ", ".join(["gradient checkpointing" if checkpointing else "no checkpointing"]
                                    + (["fp8 base"] if fp8 else []) + (["cache filled, encoders on CPU"] if cached else []))
                print(f"| {family} | {setting} | {e.weights / GIB:.2f} | {e.total / GIB:.2f} | "
                      f"{'yes' if plan.fits else 'no'} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
