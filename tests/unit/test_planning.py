"""`kubetune plan`'s arithmetic and decisions, on meta-device models (no forward pass here)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kubetune_api.spec import TrainingJobSpec
from kubetune_trainer.errors import ConfigError
from kubetune_api.strategy import resolve_strategy
from kubetune_trainer.planning.activations import Activations
from kubetune_trainer.planning.estimate import MemoryEstimate, estimate_from_parts
from kubetune_trainer.planning.models import load_models
from kubetune_api.fixes import suggest, with_overrides
from kubetune_trainer.planning.weights import parameter_bytes
from kubetune_trainer.models.reference_models import write_config_only

GIB = 2**30
LAYOUTS = {"sd15": "captions", "pmg": "pmg", "classifier": "image-folder"}


@pytest.fixture(scope="module")
def sd15_configs(tmp_path_factory):
    return write_config_only("sd15", tmp_path_factory.mktemp("configs") / "sd15")


def make_spec(pretrained, family="sd15", **sections) -> TrainingJobSpec:
    document = {"model": {"family": family, "pretrained": str(pretrained)},
                "data": {"layout": LAYOUTS[family], "uri": "/data", "resolution": 512},
                "training": {"maxSteps": 1, "mixedPrecision": "bf16"}, "checkpoints": {"uri": "/ck"}}
    for section, values in sections.items():
        document.setdefault(section, {}).update(values)
    return TrainingJobSpec.model_validate(document)


# --- reading the models ------------------------------------------------------------------------

@pytest.mark.parametrize("pretrained, expected", [
    ("s3://bucket/sd15", r"spec.model.pretrained: s3://bucket/sd15 is not a local folder"),
    ("org/name", r"spec.model.pretrained: org/name is not a local folder \(a model-hub id cannot be read here\)"),
])
def test_a_pretrained_that_is_not_a_local_folder_is_refused(pretrained, expected):
    with pytest.raises(ConfigError, match=expected):
        load_models(make_spec(pretrained))


def test_a_missing_config_file_is_named_with_the_field(tmp_path):
    (tmp_path / "unet").mkdir()
    with pytest.raises(ConfigError, match=rf"spec.model.pretrained: {tmp_path}/unet/config.json is missing; "
                                          r"kubetune plan reads the models' config files \(no weights\)"):
        load_models(make_spec(tmp_path))


def test_pmg_names_its_language_model_field(sd15_configs, tmp_path):
    spec = make_spec(sd15_configs, family="pmg", pmg={"languageModel": str(tmp_path)})
    with pytest.raises(ConfigError, match=rf"spec.pmg.languageModel: {tmp_path}/config.json is missing"):
        load_models(spec)


def test_lora_trains_in_fp32_on_a_frozen_base_in_the_training_precision(sd15_configs):
    models = load_models(make_spec(sd15_configs))
    unet = models.components["unet"]
    trained = [p for p in unet.parameters() if p.requires_grad]
    frozen = [p for p in unet.parameters() if not p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.device.type for p in unet.parameters()} == {"meta"}
    assert models.components["text_encoder"].dtype == torch.bfloat16


def test_full_fine_tuning_trains_every_denoiser_weight_in_fp32(sd15_configs):
    unet = load_models(make_spec(sd15_configs, adapter={"type": "full"})).components["unet"]
    assert all(p.requires_grad and p.dtype == torch.float32 for p in unet.parameters())


# --- bytes of weights ------------------------------------------------------------------------

def test_nf4_packs_linear_weights_and_leaves_the_rest():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).to(torch.bfloat16).requires_grad_(False)
    plain = parameter_bytes(model)
    quantized = parameter_bytes(model, "nf4")
    assert plain.bytes == (64 * 64 + 64 + 2 * 64) * 2
    assert quantized.bytes == int(64 * 64 * (0.5 + 4 / 64)) + (64 + 2 * 64) * 2


def test_fp8_keeps_the_layers_the_trainer_keeps_precise():
    model = torch.nn.ModuleDict({"proj_out": torch.nn.Linear(8, 8), "ff": torch.nn.Linear(8, 8)})
    model.to(torch.bfloat16).requires_grad_(False)
    # proj_out whole in bf16; ff's weight in float8 with an fp32 scale per row, its bias in bf16
    assert parameter_bytes(model, "fp8").bytes == (8 * 8 + 8) * 2 + (8 * 8 + 8 * 4) + 8 * 2


# --- the per-process sum ------------------------------------------------------------------------

ACTIVATIONS = Activations(saved=3 * GIB, largest=GIB // 8, recompute=0)


@pytest.fixture(scope="module")
def sd15_models(sd15_configs):
    return load_models(make_spec(sd15_configs))


def test_one_gpu_total_is_the_sum_of_its_parts(sd15_configs, sd15_models):
    e = estimate_from_parts(make_spec(sd15_configs), sd15_models, ACTIVATIONS, "cuda", 1, "ddp")
    trained = sum(p.numel() for p in sd15_models.components["unet"].parameters() if p.requires_grad)
    assert e.gradients == 4 * trained and e.optimizer == 8 * trained and e.ema == 0
    assert e.weights == sum(e.weights_by_model.values())
    assert e.total == (e.weights + e.gradients + e.optimizer + e.overhead + ACTIVATIONS.saved
                       + 2 * ACTIVATIONS.largest)
    assert e.peak_phase == "backward"


def test_ddp_over_several_gpus_keeps_gradient_buckets_and_ema_is_one_fp32_copy(sd15_configs, sd15_models):
    spec = make_spec(sd15_configs, training={"emaDecay": 0.999})
    alone = estimate_from_parts(spec, sd15_models, ACTIVATIONS, "cuda", 1, "ddp")
    together = estimate_from_parts(spec, sd15_models, ACTIVATIONS, "cuda", 8, "ddp")
    assert together.gradients == 2 * alone.gradients
    assert alone.ema == alone.gradients  # both one fp32 copy of the trained parameters
    assert together.weights == alone.weights


def test_fsdp_shards_the_trained_module_and_not_the_frozen_encoders(sd15_configs, sd15_models):
    spec = make_spec(sd15_configs, distributed={"strategy": "fsdp"})
    ddp = estimate_from_parts(spec, sd15_models, ACTIVATIONS, "cuda", 1, "ddp")
    fsdp = estimate_from_parts(spec, sd15_models, ACTIVATIONS, "cuda", 4, "fsdp")
    assert fsdp.weights_by_model["unet"] == pytest.approx(ddp.weights_by_model["unet"] / 4, abs=1)
    assert fsdp.weights_by_model["text_encoder"] == ddp.weights_by_model["text_encoder"]
    assert fsdp.optimizer == pytest.approx(ddp.optimizer / 4, abs=1)
    assert fsdp.backward_working > ddp.backward_working  # gathered blocks


def test_cpu_offload_moves_the_sharded_state_to_host_memory(sd15_configs, sd15_models):
    spec = make_spec(sd15_configs, distributed={"strategy": "fsdp", "cpuOffload": True})
    e = estimate_from_parts(spec, sd15_models, ACTIVATIONS, "cuda", 4, "fsdp")
    assert e.weights_by_model["unet"] == 0 and e.optimizer == 0 and e.host > 0


def test_quantization_shrinks_only_the_denoiser(sd15_configs, sd15_models):
    plain = estimate_from_parts(make_spec(sd15_configs), sd15_models, ACTIVATIONS, "cuda", 1, "ddp")
    nf4 = estimate_from_parts(make_spec(sd15_configs, model={"quantization": "nf4"}), sd15_models, ACTIVATIONS,
                              "cuda", 1, "ddp")
    # nf4 packs the Linear layers; the UNet's convolutions stay in bf16
    assert 0.5 * plain.weights_by_model["unet"] < nf4.weights_by_model["unet"] < 0.8 * plain.weights_by_model["unet"]
    assert nf4.weights_by_model["vae"] == plain.weights_by_model["vae"]


def test_the_cpu_has_no_cuda_overhead(sd15_configs, sd15_models):
    assert estimate_from_parts(make_spec(sd15_configs), sd15_models, ACTIVATIONS, "cpu", 1, "ddp").overhead == 0


# --- strategy auto ----------------------------------------------------------------------------

@pytest.mark.parametrize("sections, world, device, ddp_fits, expected", [
    ({"distributed": {"strategy": "fsdp"}}, 8, "cuda", True, "fsdp"),      # explicit wins
    ({"distributed": {"strategy": "fsdp"}}, 1, "cuda", False, "ddp"),      # ... over more than one process
    ({"distributed": {"strategy": "ddp"}}, 8, "cuda", False, "ddp"),
    ({}, 1, "cuda", False, "ddp"),                                          # nothing to shard over
    ({}, 8, "cpu", False, "ddp"),                                           # always ddp on the CPU
    ({"model": {"quantization": "nf4"}}, 8, "cuda", False, "ddp"),          # fsdp cannot shard nf4
    ({}, 8, "cuda", True, "ddp"),
    ({}, 8, "cuda", False, "fsdp"),
])
def test_auto_chooses_fsdp_only_when_ddp_does_not_fit(sd15_configs, sections, world, device, ddp_fits, expected):
    spec = make_spec(sd15_configs, **sections)
    assert resolve_strategy(spec, world, device == "cuda", lambda: ddp_fits) == expected


# --- suggestions -------------------------------------------------------------------------------

class StubPlanner:
    """Totals by rule, in GiB: 30, -12 with checkpointing, -10 with nf4; FSDP over w GPUs: 6 + (total - 6) / w."""

    def estimate(self, spec, world, strategy):
        total = 30 - 12 * spec.training.gradient_checkpointing - 10 * (spec.model.quantization == "nf4")
        if strategy == "fsdp":
            total = 6 + (total - 6) / world
        parts = dict.fromkeys(f.name for f in dataclasses.fields(MemoryEstimate))
        parts.update(device="cuda", strategy=strategy, world_size=world, weights_by_model={}, notes=())
        numbers = {k: 0 for k, v in parts.items() if v is None}
        return MemoryEstimate(**{**parts, **numbers, "weights": int(total * GIB)})


@pytest.mark.parametrize("strategy, world, capacity_gib, expected", [
    ("fsdp", 1, 80, "ddp"),    # issue 30: the plan said fsdp over one process; the trainer trains unsharded
    ("fsdp", 4, 80, "fsdp"),
    ("auto", 4, 80, "ddp"),    # fits under ddp
    ("auto", 4, 20, "fsdp"),   # does not: sharded
    ("auto", 1, 20, "ddp"),
])
def test_the_plan_reports_the_strategy_the_trainer_runs(sd15_configs, strategy, world, capacity_gib, expected):
    from kubetune_api import strategy as resolution
    from kubetune_trainer import run
    from kubetune_trainer.planning import plan_job

    spec = make_spec(sd15_configs, distributed={"strategy": strategy})
    plan = plan_job(spec, int(capacity_gib * GIB), world_size=world, device="cuda", planner=StubPlanner())
    assert plan.estimate.strategy == expected
    # The trainer asks the same function (kubetune_trainer.run's _prepare_model), with its own memory answer.
    assert run.resolve_strategy is resolution.resolve_strategy
    assert resolution.resolve_strategy(spec, world, True, lambda: 30 <= capacity_gib) == expected


def test_strategy_auto_is_resolved_in_one_module_only():
    from tests.conftest import REPO

    readers = sorted(str(path.relative_to(REPO)) for folder in ("api/src", "cli/src", "operator/src", "trainer_image/src")
                     for path in (REPO / folder).rglob("*.py")
                     if re.search(r"""strategy\s*[!=]=\s*["']auto["']""", path.read_text()))
    assert readers == ["api/src/kubetune_api/strategy.py"]


CHECKPOINTING = "spec.training.gradientCheckpointing=true"
FSDP = "spec.distributed.strategy=fsdp"


@pytest.mark.parametrize("capacity_gib, expected", [
    (20, [("gradient checkpointing", (CHECKPOINTING,)),
          ("nf4 quantized base", ("spec.model.quantization=nf4",)),
          ("fsdp over 2 GPUs", (FSDP, "spec.resources.nodes=1", "spec.resources.gpusPerNode=2"))]),
    (10, [("fsdp over 6 GPUs", (FSDP, "spec.resources.nodes=1", "spec.resources.gpusPerNode=6"))]),
    (7, [("fsdp over 24 GPUs", (FSDP, "spec.resources.nodes=3", "spec.resources.gpusPerNode=8"))]),
    # no single fix is enough: combinations
    (6.2, [("gradient checkpointing and fsdp over 64 GPUs",
            (CHECKPOINTING, FSDP, "spec.resources.nodes=8", "spec.resources.gpusPerNode=8"))]),
    (5, []),
])
def test_each_fix_is_estimated_and_only_fixes_that_fit_are_offered(sd15_configs, capacity_gib, expected):
    found = suggest(StubPlanner(), make_spec(sd15_configs), int(capacity_gib * GIB), "ddp")
    assert [(s.description, s.overrides) for s in found] == expected
    assert all(s.estimate.fits(int(capacity_gib * GIB)) for s in found)


def test_fsdp_keeps_the_jobs_gpus_per_node(sd15_configs):
    spec = make_spec(sd15_configs, resources={"nodes": 1, "gpusPerNode": 4})
    found = suggest(StubPlanner(), spec, 10 * GIB, "ddp")
    assert [s.overrides[-2:] for s in found] == [("spec.resources.nodes=2", "spec.resources.gpusPerNode=4")]


def test_fsdp_suggestion_drops_what_fsdp_cannot_shard(sd15_configs):
    spec = make_spec(sd15_configs, model={"quantization": "nf4"}, training={"gradientCheckpointing": True})
    found = suggest(StubPlanner(), spec, 7 * GIB, "ddp")
    assert [s.description for s in found] == ["fsdp over 16 GPUs (without model.quantization, which fsdp cannot shard)"]
    variant = with_overrides(spec, found[0].overrides)  # the printed overrides make a valid spec
    assert variant.model.quantization is None and variant.distributed.strategy == "fsdp"


def test_the_planning_package_imports_without_building_or_importing_model_libraries():
    import subprocess
    import sys

    code = ("import sys; from kubetune_trainer.planning import choose_strategy, fits_under_ddp, plan_job; "
            "sys.exit(any(m in sys.modules for m in ('diffusers', 'transformers', 'peft')))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- a forward pass as on a GPU, without one --------------------------------------------------------

def test_fused_attention_saves_q_k_v_output_and_logsumexp_not_the_scores():
    import torch.nn.functional as F

    from kubetune_trainer.planning.activations import SavedTensorMeter
    from kubetune_trainer.planning.attention import attention_kernel
    from kubetune_trainer.planning.fake_device import fake_mode

    mode, meter = fake_mode(), SavedTensorMeter()
    with mode, meter.recording(), attention_kernel("fused"):
        q, k, v = (torch.empty(2, 8, 1024, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                   for _ in range(3))
        F.scaled_dot_product_attention(q, k, v)
    tensor = 2 * 8 * 1024 * 64 * 2
    assert meter.total == 4 * tensor + 2 * 8 * 1024 * 4  # q, k, v, out in bf16; logsumexp in fp32


def test_autocast_runs_on_fake_cuda_tensors_and_is_switched_off_after():
    from kubetune_trainer.planning.fake_device import autocast_on, fake_mode

    with fake_mode():
        x = torch.empty(4, 16, device="cuda")
        weight = torch.empty(8, 16, device="cuda")
        with autocast_on("cuda", torch.bfloat16):
            assert torch.nn.functional.linear(x, weight).dtype == torch.bfloat16
            assert torch.nn.functional.layer_norm(x.bfloat16(), (16,)).dtype == torch.float32  # autocast's fp32 list
        assert torch.nn.functional.linear(x, weight).dtype == torch.float32
    assert not torch.is_autocast_enabled("cuda")
