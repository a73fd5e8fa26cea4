"""The committed CRDs are generated from the typed specs and are valid structural schemas."""
import pytest
import yaml

from kubetune_api.crd import build_crd, build_sweep_crd, render_crd, rendered_files

FILES = rendered_files()


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_crd_matches_the_model(path):
    assert path.read_text() == FILES[path], (
        f"{path} drifted from kubetune_api.spec / kubetune_api.sweep; run `make crd` and commit the result"
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


@pytest.mark.parametrize("build", [build_crd, build_sweep_crd])
def test_schema_uses_only_structural_keywords(build):
    forbidden = {"$ref", "anyOf", "allOf", "oneOf", "title", "$defs", "const"}
    for path, node in walk(build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]):
        assert not forbidden & node.keys(), f"{path} has {forbidden & node.keys()}"
        assert node.get("additionalProperties") is not False, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
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
    # A side or [width, height]: no single type for the schema (and so no CEL): the webhook checks it.
    assert spec["data"]["properties"]["resolution"]["x-kubernetes-preserve-unknown-fields"] is True
    assert not any("resolution" in r["rule"] for r in spec["data"]["x-kubernetes-validations"])
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


def test_sweep_crd_checks_its_template_as_a_training_job():
    crd = build_sweep_crd()
    assert crd["metadata"]["name"] == "trainingsweeps.kubetune.dev"
    assert crd["spec"]["names"]["shortNames"] == ["tsw"]
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    template = spec["properties"]["template"]["properties"]["spec"]
    job_spec = spec_schema()["properties"]["spec"]
    assert template["properties"] == job_spec["properties"]
    assert template["x-kubernetes-validations"] == job_spec["x-kubernetes-validations"]
    assert spec["properties"]["algorithm"]["enum"] == ["grid", "random", "bayesian", "pbt"]
    distribution = spec["properties"]["parameters"]["additionalProperties"]["properties"]
    assert distribution["choice"]["items"] == {"x-kubernetes-preserve-unknown-fields": True}  # numbers or words
    assert distribution["step"]["type"] == "number"
    assert "maxTrials" in spec["x-kubernetes-validations"][0]["rule"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Trials"] == ".status.trialsDone" and columns["Best"] == ".status.best.value"
