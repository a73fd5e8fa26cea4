"""Which quantized bases a process can train (a pure decision, unit-tested here) and the runtime refusal."""
import pytest
import torch

from kubetune_trainer.training import quantization
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.training.quantization import refusal

BOTH = frozenset({"bitsandbytes", "torchao"})

DECISIONS = [
    # (kind, GPU compute capability or None, installed packages, expected words or None = runs)
    (None, None, frozenset(), None),
    ("nf4", None, BOTH, "spec.model.quantization: nf4 needs a CUDA GPU with bitsandbytes; this process has no GPU"),
    ("nf4", (7, 5), BOTH, None),
    ("nf4", (9, 0), frozenset({"torchao"}), "spec.model.quantization: nf4 needs bitsandbytes: pip install"),
    ("fp8", None, BOTH, "spec.model.quantization: fp8 needs a CUDA GPU of compute capability 8.9+"),
    ("fp8", (8, 0), BOTH, "fp8 needs compute capability 8.9+ (Ada, Hopper); this GPU has 8.0: use nf4"),
    ("fp8", (8, 6), BOTH, "this GPU has 8.6"),
    ("fp8", (8, 9), BOTH, None),
    ("fp8", (9, 0), BOTH, None),
    ("fp8", (12, 0), BOTH, None),
    ("fp8", (9, 0), frozenset({"bitsandbytes"}), "spec.model.quantization: fp8 needs torchao: pip install"),
    ("int4", (9, 0), BOTH, "spec.model.quantization: unsupported 'int4'"),
]


@pytest.mark.parametrize("kind,capability,importable,expected", DECISIONS,
                         ids=[f"{k}-{c}-{'+'.join(sorted(i)) or 'none'}" for k, c, i, _ in DECISIONS])
def test_refusal_names_the_option_and_why(kind, capability, importable, expected):
    reason = refusal(kind, capability, importable)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason


@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_a_process_without_a_gpu_is_refused_at_run_time(monkeypatch, kind):
    monkeypatch.setattr(quantization, "cuda_capability", lambda: None)
    with pytest.raises(ConfigError, match=f"spec.model.quantization: {kind} needs a CUDA GPU"):
        quantization.check_supported(kind)


def test_a_process_with_a_recent_gpu_and_the_shipped_packages_may_quantize(monkeypatch):
    monkeypatch.setattr(quantization, "cuda_capability", lambda: (9, 0))
    for kind in (None, "nf4", "fp8"):
        quantization.check_supported(kind)  # bitsandbytes and torchao come with the [trainer] extra


def test_cuda_capability_on_this_machine_matches_torch():
    expected = tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    assert quantization.cuda_capability() == expected


def test_installed_finds_packages_without_importing_them():
    assert quantization.installed("torch", "no_such_package_kubetune") == frozenset({"torch"})


def test_nf4_quantizes_while_loading_in_the_compute_dtype():
    config = quantization.load_kwargs("nf4", torch.bfloat16)["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantization.load_kwargs("fp8", torch.bfloat16) == {} and quantization.load_kwargs(None, torch.float32) == {}


def test_fp8_quantizes_after_loading_and_nothing_else_does():
    from kubetune_trainer.training.fp8 import is_float8

    for kind, float8 in (("fp8", True), ("nf4", False), (None, False)):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16))
        quantization.apply_after_load(kind, model, torch.float32)
        assert is_float8(model[0].weight) is float8, kind
