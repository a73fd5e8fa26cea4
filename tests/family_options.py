"""For each option of the families table (kubetune_api.families), a setting that makes it act:
the unit tests check that the families ignoring it refuse it, the trainer tests that the families
honouring it train differently with it."""
from __future__ import annotations

from kubetune_api import families as table

# Dotted manifest fields -> values; each entry sets its option to something other than "off".
SETTINGS: dict[str, dict] = {
    table.QUANTIZATION: {"spec.model.quantization": "nf4"},
    table.VAE: {"spec.model.vae": "/models/other-vae"},
    table.INIT_FROM: {"spec.adapter.initFrom": "/loras/start"},
    table.FULL_FINE_TUNE: {"spec.adapter.type": "full"},
    table.LORA_RANK: {"spec.adapter.rank": 16},
    table.LORA_ALPHA: {"spec.adapter.alpha": 32.0},
    table.LORA_DROPOUT: {"spec.adapter.dropout": 0.5},
    table.LORA_TARGETS: {"spec.adapter.targetModules": ["to_q"]},
    table.BUCKETING: {"spec.data.bucketing": True},
    table.CAPTION_DROPOUT: {"spec.data.captionDropout": 1.0},
    table.CONTROL_DROPOUT: {"spec.data.controlDropout": 1.0},
    table.EMBEDDING_CACHE: {"spec.data.cache.enabled": True},
    table.ENCODER_DEVICE: {"spec.model.encoderDevice": "cpu", "spec.data.cache.enabled": True},
    table.SNR_GAMMA: {"spec.training.snrGamma": 0.05},  # below most noise levels: it weights
    table.NOISE_OFFSET: {"spec.training.noiseOffset": 0.5},
    table.VALIDATION_PROMPTS: {"spec.validation.prompts": ["a red circle"]},
    table.GUIDANCE: {"spec.validation.guidanceScale": 9.0},
    table.CLIP_MODEL: {"spec.validation.clipModel": "openai/clip-vit-base-patch32"},
    table.EXPERTS: {"spec.model.experts": "high-noise"},
}


def with_family(family: str) -> dict:
    """The dotted fields that make a job of FAMILY (its first layout)."""
    return {"spec.model.family": family, "spec.data.layout": table.FAMILIES[family].layouts[0]}


def combinations(honoured: bool) -> list[tuple[str, str]]:
    """(family, option) pairs the table marks honoured (or not), in table order."""
    return [(family, option) for family, info in table.FAMILIES.items() for option in table.OPTIONS
            if (option in info.honours) == honoured]


def set_fields(document: dict, changes: dict) -> dict:
    """A copy of DOCUMENT (a manifest) with each dotted field set, parents made as needed."""
    from kubetune_api.sweep import with_value

    for dotted, value in changes.items():
        document = with_value(document, dotted, value)
    return document
