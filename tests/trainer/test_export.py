"""`kubetune export`: each format loads where it is meant to, and bad requests are refused, nothing overwritten.

One two-step run per family, shared by the module; the kohya files are read back through diffusers'
own loader (which converts them as it converts ComfyUI's and kohya's files) and must give the same
LoRA as the diffusers file, on every module it adapts.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open

from kubetune_cli.main import cli
from kubetune_trainer.results.export import lora_files
from kubetune_trainer.families import definition_for
from kubetune_trainer.families.lora import LORA_FILE
from tests.trainer.conftest import family_job, run_dir, run_trainer

pytestmark = pytest.mark.slow

KOHYA_FAMILIES = ["sd15", "sdxl", "qwen-image", "z-image", "wan"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, tiny_dataset, sd15_run, sdxl_run):
    """runs(family): the job directory of a finished two-step run (checkpoint-2 and final weights); SD1.5's
    and SDXL's are the session's shared runs."""
    made: dict[str, Path] = {"sd15": run_dir(sd15_run[1]).parent, "sdxl": run_dir(sdxl_run).parent}

    def make(family: str) -> Path:
        if family not in made:
            tmp = tmp_path_factory.mktemp(f"run-{family}")
            run_trainer(family_job(family, "captions", tiny_model(family), tiny_dataset("captions"), tmp / "out"), tmp)
            made[family] = run_dir(tmp / "out").parent
        return made[family]
    return make


def kubetune(*args) -> object:
    return CliRunner().invoke(cli, ["export", *map(str, args)], catch_exceptions=False)


def exported(*args) -> None:
    result = kubetune(*args)
    assert result.exit_code == 0, result.output


def lora_deltas(pipeline) -> dict[str, torch.Tensor]:
    """What each LoRA-adapted layer of the pipeline adds to its weight (B·A·alpha/r), by component and module."""
    deltas = {}
    for component, model in pipeline.components.items():
        for name, module in model.named_modules() if isinstance(model, torch.nn.Module) else ():
            if getattr(module, "lora_A", None):
                (adapter,) = module.lora_A.keys()
                deltas[f"{component}.{name}"] = (module.lora_B[adapter].weight @ module.lora_A[adapter].weight
                                                 * module.scaling[adapter])
    return deltas


def pipeline_with(family: str, model: Path, folder: Path | None, names: dict[str, str] | None = None):
    """The family's pipeline from `model`, with each LoRA file of the diffusers export `folder` loaded
    (or the file `names` gives for it), as the family's DEFINITION says to load it."""
    definition = definition_for(family)
    pipeline = getattr(diffusers, definition.pipeline).from_pretrained(model)
    for file, kwargs in (lora_files(definition, folder) if folder else {}).items():
        pipeline.load_lora_weights(str(folder), weight_name=(names or {}).get(file, file), **kwargs)
    return pipeline


@pytest.mark.parametrize("family", KOHYA_FAMILIES)
def test_the_kohya_file_loads_whole_through_diffusers_as_the_same_lora(family, runs, tiny_model, tmp_path):
    exported(runs(family), "--format", "kohya", "--out", tmp_path / "d")
    exported(runs(family), "--format", "diffusers", "--out", tmp_path / "d", "--force")
    names = {file: file.replace("pytorch_lora_weights", "tiny") for file in lora_files(definition_for(family), tmp_path / "d")}
    keys = []
    for name in names.values():
        with safe_open(str(tmp_path / "d" / name), "pt") as opened:
            keys += list(opened.keys())
    prefix = next(iter(definition_for(family).kohya.prefixes.values()))
    assert keys and all(key.startswith(prefix) for key in keys)
    assert all(key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for key in keys)

    ours = lora_deltas(pipeline_with(family, tiny_model(family), tmp_path / "d"))
    theirs = lora_deltas(pipeline_with(family, tiny_model(family), tmp_path / "d", names))
    assert len(theirs) == sum(key.endswith(".alpha") for key in keys), "every pair in the files became a LoRA layer"
    assert theirs.keys() == ours.keys()
    assert any(delta.abs().max() > 0 for delta in ours.values()), "the two steps trained something"
    for name, delta in ours.items():
        torch.testing.assert_close(theirs[name], delta, rtol=1e-5, atol=1e-7, msg=name)


def unet_output(pipeline) -> torch.Tensor:
    unet = pipeline.unet
    noise = torch.Generator().manual_seed(0)
    latents = torch.randn(1, unet.config.in_channels, 8, 8, generator=noise)
    text = torch.randn(1, 7, unet.config.cross_attention_dim, generator=noise)
    with torch.no_grad():
        return unet(latents, torch.tensor([500]), encoder_hidden_states=text).sample


def test_sd15_kohya_export_gives_the_same_denoiser_output_as_the_diffusers_file(runs, tiny_model, tmp_path):
    exported(runs("sd15"), "--format", "kohya", "--out", tmp_path / "kohya")
    exported(runs("sd15"), "--format", "diffusers", "--out", tmp_path / "diffusers")
    model = tiny_model("sd15")
    with_ours = unet_output(pipeline_with("sd15", model, tmp_path / "diffusers"))
    shutil.copy(tmp_path / "kohya" / "tiny.safetensors", tmp_path / "diffusers")
    with_kohya = unet_output(pipeline_with("sd15", model, tmp_path / "diffusers", {LORA_FILE: "tiny.safetensors"}))
    base = unet_output(pipeline_with("sd15", model, None))
    assert (with_ours - base).abs().max() > 1e-4
    torch.testing.assert_close(with_kohya, with_ours, rtol=1e-5, atol=1e-6)


def generate(pipeline) -> np.ndarray:
    return pipeline("a red square", num_inference_steps=2, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images


def test_the_merged_export_is_a_pipeline_that_draws_what_base_plus_lora_draws(runs, tiny_model, tmp_path):
    exported(runs("sd15"), "--format", "merged", "--dtype", "fp32", "--out", tmp_path / "merged")
    merged = diffusers.StableDiffusionPipeline.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.unet.named_parameters()), "fused, not an adapter"
    with_lora = pipeline_with("sd15", tiny_model("sd15"), run_dir_of(runs("sd15")))
    base = pipeline_with("sd15", tiny_model("sd15"), None)
    assert np.abs(generate(with_lora) - generate(base)).max() > 1e-3, "the LoRA changes the images"
    np.testing.assert_allclose(generate(merged), generate(with_lora), atol=1e-4)

    exported(runs("sd15"), "--format", "merged", "--dtype", "fp16", "--out", tmp_path / "half")
    with safe_open(str(tmp_path / "half" / "unet" / "diffusion_pytorch_model.safetensors"), "pt") as unet:
        assert {unet.get_tensor(key).dtype for key in unet.keys()} == {torch.float16}


def run_dir_of(job_dir: Path) -> Path:
    return job_dir / "v0"


def test_the_diffusers_export_of_a_checkpoint_keeps_the_metadata_in_the_asked_dtype(runs, tmp_path):
    exported(runs("sd15"), "--format", "diffusers", "--step", "2", "--dtype", "bf16", "--out", tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [LORA_FILE], "the weights, not the training state"
    with safe_open(str(run_dir_of(runs("sd15")) / "checkpoint-2" / LORA_FILE), "pt") as saved, \
            safe_open(str(tmp_path / "d" / LORA_FILE), "pt") as written:
        assert written.metadata() == saved.metadata()
        assert set(written.keys()) == set(saved.keys())
        for key in saved.keys():
            assert written.get_tensor(key).dtype == torch.bfloat16
            torch.testing.assert_close(written.get_tensor(key), saved.get_tensor(key).to(torch.bfloat16))


def run_of_family(runs, tmp_path: Path, family: str, **spec_changes) -> Path:
    """A copy of the SD1.5 run whose job.yaml names another family: what export reads before any weights."""
    job_dir = tmp_path / "copy"
    shutil.copytree(runs("sd15"), job_dir)
    job_file = run_dir_of(job_dir) / "job.yaml"
    job = yaml.safe_load(job_file.read_text())
    job["spec"]["model"]["family"] = family
    for section, values in spec_changes.items():
        job["spec"][section] = values
    job_file.write_text(yaml.safe_dump(job))
    return job_dir


@pytest.mark.parametrize("family, spec_changes, message", [
    ("sd35", {}, "--format kohya: sd35 has no kohya-style LoRA convention that diffusers also reads; "
                 "sd35 exports as diffusers or merged"),
    ("pmg", {"adapter": {}, "data": {"layout": "pmg", "uri": "/data", "resolution": 32}},
     "--format kohya: pmg trains no diffusers LoRA and has no diffusers pipeline to merge into; pmg exports as diffusers"),
    ("sd15", {"adapter": {"type": "full"}},
     "--format kohya: the run is a full fine-tune (spec.adapter.type full): there is no LoRA to convert; "
     "sd15 exports as diffusers or merged"),
])
def test_kohya_is_refused_naming_the_family_and_the_formats_it_has(runs, tmp_path, family, spec_changes, message):
    result = kubetune(run_of_family(runs, tmp_path, family, **spec_changes), "--format", "kohya", "--out", tmp_path / "k")
    assert result.exit_code == 2
    assert result.output.strip() == f"kubetune export: {message}"
    assert not (tmp_path / "k").exists()


def test_merged_is_refused_for_pmg(runs, tmp_path):
    job_dir = run_of_family(runs, tmp_path, "pmg", adapter={}, data={"layout": "pmg", "uri": "/d", "resolution": 32})
    result = kubetune(job_dir, "--format", "merged", "--out", tmp_path / "m")
    assert result.exit_code == 2 and "--format merged: pmg trains no diffusers LoRA" in result.output


def test_an_existing_output_is_never_overwritten_without_force(runs, tmp_path):
    as_file = tmp_path / "file.safetensors"
    as_file.write_text("mine")
    result = kubetune(runs("sd15"), "--format", "diffusers", "--out", as_file)
    assert result.exit_code == 2 and f"--out {as_file} exists as a file" in result.output
    assert as_file.read_text() == "mine"

    full = tmp_path / "full"
    full.mkdir()
    (full / LORA_FILE).write_text("mine")
    result = kubetune(runs("sd15"), "--format", "diffusers", "--out", full)
    assert result.exit_code == 2 and "is not empty: give a new folder, or pass --force" in result.output
    assert (full / LORA_FILE).read_text() == "mine"

    exported(runs("sd15"), "--format", "diffusers", "--out", full, "--force")
    with safe_open(str(full / LORA_FILE), "pt") as replaced:
        assert list(replaced.keys())


def test_nothing_is_written_through_a_symbolic_link(runs, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    result = kubetune(runs("sd15"), "--format", "diffusers", "--out", tmp_path / "link")
    assert result.exit_code == 2 and "is a symbolic link" in result.output

    out = tmp_path / "out"
    out.mkdir()
    (out / LORA_FILE).symlink_to(elsewhere / "victim")
    result = kubetune(runs("sd15"), "--format", "diffusers", "--out", out, "--force")
    assert result.exit_code == 2 and "through a symbolic link" in result.output
    assert list(elsewhere.iterdir()) == []


def test_a_missing_step_or_final_weights_is_named_with_what_exists(runs, tmp_path):
    result = kubetune(runs("sd15"), "--format", "diffusers", "--step", "3", "--out", tmp_path / "x")
    assert result.exit_code == 2
    assert "--step 3:" in result.output and "has no complete checkpoint-3; it has checkpoints at steps 2" in result.output

    unfinished = run_of_family(runs, tmp_path, "sd15")
    (run_dir_of(unfinished) / LORA_FILE).unlink()
    (run_dir_of(unfinished) / "run.json").write_text('{"runId": null, "steps": 2, "finished": false}')
    result = kubetune(unfinished, "--format", "kohya", "--out", tmp_path / "x")
    assert result.exit_code == 2
    assert "has no final weights (the run has not finished); it has checkpoints at steps 2" in result.output
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model, tiny_dataset) -> Path:
    """A finished two-step full fine-tune of SD1.5: its final weights are the unet/ folder."""
    tmp = tmp_path_factory.mktemp("run-full")
    run_trainer(family_job("sd15", "captions", tiny_model("sd15"), tiny_dataset("captions"), tmp / "out",
                           adapter={"type": "full", "rank": None, "alpha": None}), tmp)
    return run_dir(tmp / "out").parent


def test_a_full_fine_tune_exports_its_model_folder_and_merges_it_into_the_base(full_run, tiny_model, tmp_path):
    from safetensors.torch import load_file

    listed = CliRunner().invoke(cli, ["checkpoints", "ls", str(full_run)], catch_exceptions=False).output
    assert "unet/diffusion_pytorch_model.safetensors" in next(l for l in listed.splitlines() if "final" in l)

    exported(full_run, "--format", "diffusers", "--out", tmp_path / "d")
    exported(full_run, "--format", "merged", "--out", tmp_path / "m")
    trained = load_file(tmp_path / "d" / "unet" / "diffusion_pytorch_model.safetensors")
    merged = load_file(tmp_path / "m" / "unet" / "diffusion_pytorch_model.safetensors")
    base = load_file(tiny_model("sd15") / "unet" / "diffusion_pytorch_model.safetensors")
    assert merged.keys() == trained.keys()
    assert all(torch.equal(merged[key], trained[key]) for key in trained)
    assert any(not torch.equal(trained[key], base[key]) for key in trained), "the two steps trained the UNet"
    assert (tmp_path / "m" / "model_index.json").is_file()

    result = kubetune(full_run, "--format", "diffusers", "--step", "2", "--out", tmp_path / "c")
    assert result.exit_code == 2
    assert "checkpoints hold only the training state): export --step final" in result.output


@pytest.mark.parametrize("family, adapted", [
    ("wan", {"transformer", "transformer_2"}),  # Wan 2.2's two experts: each LoRA file into its own transformer
    ("qwen-image", {"transformer"}),
])
def test_the_merged_export_holds_base_plus_every_lora_file(family, adapted, runs, tiny_model, tmp_path):
    exported(runs(family), "--format", "merged", "--out", tmp_path / "m")
    with_lora = pipeline_with(family, tiny_model(family), run_dir_of(runs(family)))
    deltas = lora_deltas(with_lora)
    assert {name.split(".")[0] for name in deltas} == adapted
    merged = getattr(diffusers, definition_for(family).pipeline).from_pretrained(tmp_path / "m")
    base = getattr(diffusers, definition_for(family).pipeline).from_pretrained(tiny_model(family))
    merged_weights = {name: p for name, p in merged.components.items() if isinstance(p, torch.nn.Module)}
    base_weights = {name: p for name, p in base.components.items() if isinstance(p, torch.nn.Module)}
    for name, delta in deltas.items():
        component, module = name.split(".", 1)
        expected = base_weights[component].get_submodule(module).weight + delta
        torch.testing.assert_close(merged_weights[component].get_submodule(module).weight, expected,
                                   rtol=1e-5, atol=1e-6, msg=name)
