"""The families table (kubetune_api.families) is the one list of families: every other list is
keyed by it, and every option a family ignores is refused, naming the field and the family, by
the same rule the API server runs (tests/unit/test_rules.py checks the CEL side)."""
from __future__ import annotations

import pytest

from kubetune_api import families as table
from kubetune_api.manifest import ManifestError, parse_manifest
from kubetune_api.spec import FAMILY_OPTIONS, TrainingJobSpec
from tests.family_options import SETTINGS, combinations, set_fields, with_family


def test_every_list_of_families_is_keyed_by_the_table():
    from kubetune_api.spec import LAYOUTS_BY_FAMILY, NATIVE_RESOLUTIONS
    from kubetune_cli.main import FAMILIES as CLI_FAMILIES
    from kubetune_trainer.families import FAMILIES as REGISTRY
    from kubetune_trainer.planning.forwards import RECIPES
    from kubetune_trainer.planning.models import TRAINED
    from kubetune_trainer.reference_models import ARCHITECTURES
    from kubetune_trainer.tiny_models import WRITERS

    names = set(table.FAMILY_NAMES)
    profiles = [name for name, family in table.FAMILIES.items() if family.profile]
    for listing in (REGISTRY, WRITERS, ARCHITECTURES, RECIPES, TRAINED, profiles, CLI_FAMILIES,
                    LAYOUTS_BY_FAMILY, NATIVE_RESOLUTIONS):
        assert set(listing) == names
    assert set(TrainingJobSpec.model_json_schema()["$defs"]["ModelSpec"]["properties"]["family"]["enum"]) == names


def test_every_layout_the_api_accepts_is_read_by_the_trainer_and_has_tiny_data():
    from typing import get_args

    from kubetune_api.spec import Layout
    from kubetune_trainer.data.layouts import LAYOUTS
    from kubetune_trainer.tiny_data import WRITERS

    accepted = set(get_args(Layout))
    assert set(LAYOUTS) == set(WRITERS) == accepted
    assert {layout for family in table.FAMILIES.values() for layout in family.layouts} == accepted


def test_the_quantized_denoisers_are_the_families_honouring_quantization():
    from kubetune_api.fixes import QUANTIZABLE
    from kubetune_trainer.planning.models import QUANTIZED

    assert set(QUANTIZED) == set(QUANTIZABLE) == set(table.honouring(table.QUANTIZATION))


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
