"""The committed CRD is generated from the typed spec and is a valid structural schema."""
import pytest
import yaml

from kubetune_api.crd import CRD_PATHS, build_crd, render_crd


@pytest.mark.parametrize("path", CRD_PATHS, ids=lambda p: str(p.parent.name))
def test_committed_crd_matches_the_model(path):
    assert path.read_text() == render_crd(), (
        f"{path} drifted from kubetune_api.spec; run `make crd` and commit the result"
    )


def walk(schema, path="openAPIV3Schema"):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def spec_schema():
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_schema_uses_only_structural_keywords():
    forbidden = {"$ref", "anyOf", "allOf", "oneOf", "title", "$defs", "const"}
    for path, node in walk(spec_schema()):
        assert not forbidden & node.keys(), f"{path} has {forbidden & node.keys()}"
        assert node.get("additionalProperties") is not False, path
        assert "type" in node, f"{path} has no type"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_every_spec_field_is_described_for_kubectl_explain():
    spec = spec_schema()["properties"]["spec"]
    undescribed = [path for path, node in walk(spec, "spec")
                   if not node.get("description") and not path.endswith(("[]", "{}"))]
    assert undescribed == []


def test_bounds_reach_the_api_server():
    spec = spec_schema()["properties"]["spec"]["properties"]
    assert spec["adapter"]["properties"]["rank"]["minimum"] == 1
    assert spec["adapter"]["properties"]["rank"]["maximum"] == 1024
    assert spec["data"]["properties"]["resolution"]["multipleOf"] == 8
    assert spec["training"]["properties"]["learningRate"]["exclusiveMinimum"] is True
    assert spec["model"]["properties"]["family"]["enum"][0] == "sd15"
    rules = [r["rule"] for r in spec["training"]["x-kubernetes-validations"]]
    assert rules[0] == "has(self.maxSteps) != has(self.epochs)"


def test_crd_names_short_name_and_printer_columns():
    crd = yaml.safe_load(render_crd())
    assert crd["metadata"]["name"] == "trainingjobs.kubetune.dev"
    assert crd["spec"]["names"]["shortNames"] == ["tj"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Loss"] == ".status.progress.loss"


def test_cuda_only_options_reach_the_api_server_in_the_python_words():
    from kubetune_api.spec import CUDA_ONLY_OPTIONS

    rules = {r["message"]: r["rule"] for r in spec_schema()["properties"]["spec"]["x-kubernetes-validations"]}
    for option in CUDA_ONLY_OPTIONS:
        assert rules.get(option.message) == option.rule.cel, option.field
        assert "has(self.resources.gpusPerNode)" in option.rule.cel, "absent = the default, one GPU"
