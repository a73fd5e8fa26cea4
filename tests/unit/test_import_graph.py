"""The product's modules import each other one way: no circle, not even through an import inside a
function (which would only hide one), and the trainer's planning reads the families, never the reverse.

The graph is read from the source (ast), every `import` and `from ... import` wherever it stands,
resolved to the product's own modules (a name imported from a package that is a submodule counts as
that module); what a package's __init__ hands on is followed like any module.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

SOURCES = {"kubetune_api": "api/src", "kubetune_cli": "cli/src", "kubetune_trainer": "trainer_image/src",
           "kubetune_operator": "operator/src", "kubetune_dev": "devcluster/src"}


def modules() -> dict[str, Path]:
    found = {}
    for package, root in SOURCES.items():
        base = REPO / root
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The product modules NAME (at PATH) imports, wherever the import stands."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(anchor[:len(anchor) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    # A module's own packages are loaded before it whatever it imports (`from its_package import
    # sibling` names the package only to reach the sibling): no edge to them.
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {candidate for candidate in found if candidate in known and candidate != name} - ancestors


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_product_modules_import_each_other_in_a_circle():
    assert circles(graph()) == []


def test_the_check_finds_a_circle_held_open_inside_a_function(tmp_path, monkeypatch):
    package = tmp_path / "kubetune_api"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from kubetune_api import b\n")
    (package / "b.py").write_text("def late():\n    from kubetune_api.a import thing\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    monkeypatch.setattr(f"{__name__}.SOURCES", {"kubetune_api": "."})
    assert circles(graph()) == [["kubetune_api.a", "kubetune_api.b"]]


def test_planning_reads_the_families_and_no_family_reads_planning():
    edges = graph()
    families = {m for m in edges if m.startswith("kubetune_trainer.families")}
    planning = {m for m in edges if m.startswith("kubetune_trainer.planning")}
    assert any(edges[m] & families for m in planning), "planning builds each family's models"
    assert not [(m, sorted(edges[m] & planning)) for m in families if edges[m] & planning]
