"""A family is one row (kubetune_api.families) and one module (its DEFINITION): every other list of
families derives from those two, a family added as only a row and a module shows in all of them,
no other code asks which family it is, and every option a family ignores is refused, naming the
field and the family, by the same rule the API server runs (tests/unit/test_rules.py checks the
CEL side)."""
from __future__ import annotations

import re

import pytest

from kubetune_api import families as table
from kubetune_api.manifest import ManifestError, parse_manifest
from kubetune_api.spec import FAMILY_OPTIONS, TrainingJobSpec
from tests.family_options import SETTINGS, combinations, set_fields, with_family


def test_every_list_of_families_derives_from_the_table():
    from kubetune_api.spec import LAYOUTS_BY_FAMILY, NATIVE_RESOLUTIONS
    from kubetune_cli.main import FAMILIES as CLI_FAMILIES
    from kubetune_trainer.families import definitions

    names = set(table.FAMILY_NAMES)
    for listing in (definitions(), CLI_FAMILIES, LAYOUTS_BY_FAMILY, NATIVE_RESOLUTIONS):
        assert set(listing) == names
    assert set(TrainingJobSpec.model_json_schema()["$defs"]["ModelSpec"]["properties"]["family"]["enum"]) == names
    assert all(family.profile is not None for family in table.FAMILIES.values())


def test_each_family_module_declares_what_the_trainer_derives_from_it():
    from kubetune_trainer.families import definitions, module_name

    for name, definition in definitions().items():
        assert definition.family.__module__ == module_name(name), name
        assert definition.quantized in (None, *definition.architecture), name
        # The trained module is a component, or what the family builds beside them (PMG's adapter).
        assert definition.trained in definition.architecture or definition.meta_trainable, name
        assert not definition.pipeline or definition.scheduler, name  # a config-only pipeline folder needs one
        assert set(definition.auto_classes) | set(definition.elsewhere) <= set(definition.architecture), name


TOY_FAMILY = "toy-family"
TOY_MODULE = "kubetune_trainer.families.toy_family"


@pytest.fixture
def toy_family(monkeypatch):
    """A family that exists only as a row and a module (a Stable Diffusion at toy width): every list
    of families must show it without being told."""
    import dataclasses
    import sys
    import types

    from kubetune_trainer.families import sd15
    from kubetune_trainer.families.components import CLIP_L_TEXT, SD_VAE, Component

    unet = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8)
    module = types.ModuleType(TOY_MODULE)
    module.DEFINITION = dataclasses.replace(sd15.DEFINITION, architecture={
        "unet": Component("unet", "diffusers", "UNet2DConditionModel", unet),
        "text_encoder": Component("text_encoder", "transformers", "CLIPTextModel",
                                  {**CLIP_L_TEXT, "hidden_size": 32, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "intermediate_size": 64}),
        "vae": Component("vae", "diffusers", "AutoencoderKL", {**SD_VAE, "block_out_channels": (32, 32),
                                                               "down_block_types": ("DownEncoderBlock2D",) * 2,
                                                               "up_block_types": ("UpDecoderBlock2D",) * 2}),
    })
    monkeypatch.setitem(sys.modules, TOY_MODULE, module)
    monkeypatch.setitem(table.FAMILIES, TOY_FAMILY, dataclasses.replace(table.FAMILIES["sd15"], name=TOY_FAMILY))
    return module.DEFINITION


def test_a_family_added_as_a_row_and_a_module_is_in_every_derived_list(toy_family, tmp_path):
    from kubetune_api.fit import coarse_estimate
    from kubetune_trainer.families import definition_for, definitions, family_for
    from kubetune_trainer.planning.estimate import Planner
    from kubetune_trainer.models.reference_models import architecture, write_config_only
    from kubetune_trainer.models.tiny_models import write_tiny_model

    assert definition_for(TOY_FAMILY) is toy_family and TOY_FAMILY in definitions()
    assert family_for(TOY_FAMILY) is toy_family.family
    assert architecture(TOY_FAMILY) == toy_family.architecture
    assert (write_tiny_model(TOY_FAMILY, tmp_path / "tiny") / "model_index.json").is_file()
    configs = write_config_only(TOY_FAMILY, tmp_path / "configs")
    assert {p.parent.name for p in configs.glob("*/config.json")} == {"unet", "text_encoder", "vae"}
    sd15 = TrainingJobSpec.model_validate({
        "model": {"family": "sd15", "pretrained": str(configs)}, "data": {"layout": "captions", "uri": "/data", "resolution": 64},
        "training": {"maxSteps": 1}, "checkpoints": {"uri": "/ck"}})
    spec = sd15.model_copy(update={"model": sd15.model.model_copy(update={"family": TOY_FAMILY})})
    estimate = Planner("cuda").estimate(spec, 1, "ddp")  # the planner builds and runs the toy architecture
    assert set(estimate.weights_by_model) == {"unet", "text_encoder", "vae"} and estimate.activations > 0
    assert coarse_estimate(spec).total == coarse_estimate(sd15).total  # the operator reads the row's profile


def test_no_code_outside_a_family_module_asks_which_family_it_is():
    """Per-family facts live in the family's row or module; everything else reads them."""
    import re

    from tests.conftest import REPO

    asks = re.compile(r"family\s*(?:==|!=)\s*[\"'][\w-]+[\"']|family\s+(?:not\s+)?in\s+[(\[{]\s*[\"']")
    own = REPO / "trainer_image" / "src" / "kubetune_trainer" / "families"
    roots = [REPO / "api" / "src", REPO / "operator" / "src", REPO / "cli" / "src", REPO / "trainer_image" / "src",
             REPO / "devcluster" / "src", REPO / "benchmarks"]
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for root in roots for path in sorted(root.rglob("*.py")) if not path.is_relative_to(own)
             for number, line in enumerate(path.read_text().splitlines(), 1) if asks.search(line)]
    assert found == []


def test_every_layout_the_api_accepts_is_read_by_the_trainer_and_a_family_and_has_tiny_data():
    from typing import get_args

    from kubetune_api.spec_data import Layout
    from kubetune_trainer.data.layouts import LAYOUTS
    from kubetune_trainer.data.tiny_data import WRITERS

    accepted = set(get_args(Layout))
    assert set(LAYOUTS) == set(WRITERS) == accepted
    read = {layout for family in table.FAMILIES.values() for layout in family.layouts}
    assert read == accepted, f"a layout no family reads: {sorted(accepted - read)}"


def test_the_families_declaring_a_quantized_denoiser_are_those_honouring_quantization():
    from kubetune_trainer.families import definitions

    quantized = {name for name, definition in definitions().items() if definition.quantized}
    assert quantized == set(table.honouring(table.QUANTIZATION))


def test_every_option_of_the_table_has_one_rule_shape_and_one_setting():
    assert [option.field for option in FAMILY_OPTIONS] == list(table.OPTIONS) == list(SETTINGS)
    for family in table.FAMILIES.values():
        assert family.honours <= set(table.OPTIONS), family.name
        assert "loss" in family.metrics, family.name
    for option in table.OPTIONS:
        assert table.honouring(option), f"{option}: no family honours it; drop it from the spec"


def job(family: str, option: str | None) -> dict:
    """A job of FAMILY that sets no option of the table, or just OPTION."""
    manifest = {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "job"},
                "spec": {"data": {"uri": "s3://data/set"}, "training": {"maxSteps": 10},
                         "checkpoints": {"uri": "s3://out/runs"}, "resources": {"gpusPerNode": 1}}}
    manifest = set_fields(manifest, {**with_family(family), "spec.model.pretrained": "org/model"})
    return set_fields(manifest, SETTINGS[option] if option else {})


@pytest.mark.parametrize("family", table.FAMILY_NAMES)
def test_each_family_accepts_every_option_it_honours(family):
    parse_manifest(job(family, None))
    for honoured_family, option in combinations(honoured=True):
        if honoured_family == family:
            parse_manifest(job(family, option))


@pytest.mark.parametrize(("family", "option"), combinations(honoured=False))
def test_an_option_the_family_ignores_is_refused_naming_the_field_the_family_and_who_honours_it(
        family, option):
    with pytest.raises(ManifestError) as refused:
        parse_manifest(job(family, option))
    message = str(refused.value)
    assert f"{option}" in message and f"is not honoured by family {family}," in message, message
    assert f"it applies to {', '.join(table.honouring(option))})" in message, message


def test_the_families_page_is_the_tables():
    from tests.conftest import REPO

    assert (REPO / "docs" / "families.md").read_text() == table.markdown(), \
        "regenerate it: python -m kubetune_api.families > docs/families.md"


def test_a_rows_frame_rule_refuses_other_frame_counts_naming_the_field_and_the_nearest_that_fit(monkeypatch):
    """A video family declares the frame counts its model takes in its row (Wan: FrameRule(4, 1), 4k+1);
    the rule the spec derives from the row refuses the others. Shown on a row derived for the test."""
    import dataclasses

    from kubetune_api import spec as api

    assert [rule.message for rule in api.frame_rules(table.FAMILIES)] == [rule.message for rule in api.FRAME_RULES]
    assert len(api.FRAME_RULES) == sum(f.frame_rule != table.ANY_FRAMES for f in table.FAMILIES.values())
    row = dataclasses.replace(table.FAMILIES["sd15"], layouts=("captions", "video-captions"),
                              frame_rule=table.FrameRule(4, 1))
    monkeypatch.setitem(table.FAMILIES, "sd15", row)
    monkeypatch.setitem(api.LAYOUTS_BY_FAMILY, "sd15", row.layouts)
    monkeypatch.setattr(api, "JOB_RULES", [*api.JOB_RULES, *api.frame_rules(table.FAMILIES)])
    video = set_fields(job("sd15", None), {"spec.data.layout": "video-captions", "spec.data.frames": 81})
    parse_manifest(video)
    parse_manifest(set_fields(video, {"spec.data.frames": [1, 33, 81]}))
    for frames, named in [(80, "80 is not, the nearest are 77 and 81"),
                          ([33, 82, 3], "82 is not, the nearest are 81 and 85; 3 is not, the nearest are 1 and 5")]:
        with pytest.raises(ManifestError) as refused:
            parse_manifest(set_fields(video, {"spec.data.frames": frames}))
        message = str(refused.value)
        assert "spec.data.frames must be 4k+1 (1, 5, 9, ...) for family sd15" in message, message
        assert named in message and "33 is not" not in message, message
    assert "| sd15 | " in table.markdown()
    assert "| captions, video-captions (frames 4k+1 (1, 5, 9, ...)) |" in table.markdown()
