"""A data layout is one row (kubetune_api.data_layouts) and its trainer module: the spec's Literal, the
formats' layouts and the rules on spec.data derive from the rows, the trainer has an entry for every row,
and no other code asks which layout it is (tests/unit/test_rules.py checks the CEL side of the rules)."""
from __future__ import annotations

import re
from typing import get_args

import pytest

from kubetune_api.data_layouts import DATA_LAYOUTS, stored_as
from kubetune_api.spec_data import DATA_FORMATS, DataSpec, Layout


def test_the_spec_and_every_format_take_their_layouts_from_the_rows():
    from kubetune_api.spec import TrainingJobSpec

    schema = TrainingJobSpec.model_json_schema()["$defs"]["DataSpec"]["properties"]["layout"]
    assert list(get_args(Layout)) == schema["enum"] == list(DATA_LAYOUTS)
    assert stored_as("files") == tuple(DATA_LAYOUTS)
    for name, row in DATA_LAYOUTS.items():
        assert set(row.stored) <= set(DATA_FORMATS) - {"files"}, f"{name} names a format that does not exist"
        for data_format in DATA_FORMATS:
            takes = DataSpec.model_validate  # the format rule, as the webhook runs it
            data = {"layout": name, "uri": "/data", "format": data_format, **({"frames": 5} if row.clips else {})}
            if data_format == "files" or data_format in row.stored:
                takes(data)
            else:
                with pytest.raises(ValueError, match="spec.data.format does not fit spec.data.layout"):
                    takes(data)


def test_the_trainer_reads_stores_and_writes_tiny_data_for_every_row():
    from kubetune_trainer.data.layouts import LAYOUTS
    from kubetune_trainer.data.tiny_data import WRITERS

    assert list(LAYOUTS) == list(DATA_LAYOUTS) and set(WRITERS) == set(DATA_LAYOUTS)
    for name, row in DATA_LAYOUTS.items():
        entry = LAYOUTS[name]
        assert (entry.from_stored is not None) == bool(row.stored), f"{name}: a stored reader iff stored formats"
        assert (entry.loose is not None) == bool(row.stored), f"{name}: stored again iff stored formats"


@pytest.mark.parametrize("name", [n for n, row in DATA_LAYOUTS.items() if row.stored])
def test_a_stored_layout_written_again_reads_back_as_its_loose_samples(name, tmp_path):
    """restore_data writes each stored layout from its row's flags; the trainer reads both forms alike."""
    from kubetune_api.spec import TrainingJobSpec
    from kubetune_trainer.data.layouts import LAYOUTS
    from kubetune_trainer.data.restore_data import loose_samples, write_parquet, write_webdataset
    from kubetune_trainer.data.screening import Screen
    from kubetune_trainer.data.tiny_data import write_tiny_data

    loose = write_tiny_data(name, tmp_path / "loose", count=4, size=16, seed=0,
                            **({"frames": 5} if DATA_LAYOUTS[name].clips else {}))
    expected = [text for _, _, text, _ in loose_samples(name, loose)]
    for data_format, write in (("parquet", write_parquet), ("webdataset", write_webdataset)):
        stored = write(name, loose, tmp_path / data_format)
        spec = TrainingJobSpec.model_validate({
            "model": {"family": next(f for f, r in _families().items() if name in r.layouts), "pretrained": "/m"},
            "data": {"layout": name, "uri": str(stored), "format": data_format,
                     **({"frames": 5} if DATA_LAYOUTS[name].clips else {})},
            "training": {"maxSteps": 1}, "checkpoints": {"uri": str(tmp_path / "ck")}})
        samples = LAYOUTS[name].read_samples(spec, Screen(skip_bad=False))
        assert len(samples) == len(expected), (name, data_format)


def _families():
    from kubetune_api.families import FAMILIES

    return FAMILIES


def test_no_code_outside_a_layouts_row_and_module_asks_which_layout_it_is():
    from tests.conftest import REPO

    asks = re.compile(r"layout\s*(?:==|!=)\s*[\"'][\w-]+[\"']|layout\s+(?:not\s+)?in\s+[(\[{]\s*[\"']"
                      r"|[\"'](?:" + "|".join(map(re.escape, DATA_LAYOUTS)) + r")[\"']\s*(?:==|!=|in)\s")
    roots = [REPO / "api" / "src", REPO / "operator" / "src", REPO / "cli" / "src", REPO / "trainer_image" / "src",
             REPO / "devcluster" / "src"]
    own = {REPO / "api" / "src" / "kubetune_api" / "data_layouts.py"}
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for root in roots for path in sorted(root.rglob("*.py")) if path not in own
             for number, line in enumerate(path.read_text().splitlines(), 1) if asks.search(line)]
    assert found == []


@pytest.mark.parametrize("field, flag", [("controlColumn", "edits"), ("labelColumn", "labels")])
def test_a_column_field_is_taken_only_by_the_stored_layouts_whose_row_has_that_column(field, flag):
    from pydantic import ValidationError

    from kubetune_api.spec_data import DataSpec

    for name, row in DATA_LAYOUTS.items():
        data = {"layout": name, "uri": "/data", "format": row.stored[0] if row.stored else "files", field: "x",
                **({"frames": 5} if row.clips else {})}
        if row.stored and getattr(row, flag):
            DataSpec.model_validate(data)
        else:
            with pytest.raises(ValidationError, match=f"spec.data.{field}"):
                DataSpec.model_validate(data)
