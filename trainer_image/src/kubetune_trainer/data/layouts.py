"""The data layouts under spec.data.uri (spec.data.layout), each found in its module: LAYOUTS[name] is
kubetune_trainer/data/<name, "-" as "_">.py's LAYOUT (data.layout_parts.Layout). Every family builds its
data through this table (ModelFamily's data methods); kubetune_api.families says which layouts a family
takes, kubetune_api.data_layouts what each layout is (one row each; its "how to add a layout" says where a
new one goes).
"""
from __future__ import annotations

import importlib

from kubetune_api.data_layouts import DATA_LAYOUTS
from kubetune_trainer.data.layout_parts import Layout


def module_name(layout: str) -> str:
    return f"kubetune_trainer.data.{layout.replace('-', '_')}"


LAYOUTS: dict[str, Layout] = {name: importlib.import_module(module_name(name)).LAYOUT for name in DATA_LAYOUTS}
