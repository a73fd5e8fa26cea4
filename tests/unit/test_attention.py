"""The attention kernel of a GPU run: FlashAttention 3 where it can run, else SDPA; cuDNN never; said in the log."""
from __future__ import annotations

import re

import pytest
import torch

from kubetune_trainer.training import attention
from kubetune_trainer.errors import ConfigError

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A GPU as torch.cuda describes it (these machines have none): gpu(capability)."""
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()

    def make(capability: tuple[int, int], name: str = "NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        torch.backends.cuda.enable_cudnn_sdp(True)
    yield make
    torch.backends.cuda.enable_cudnn_sdp(cudnn)


def test_a_hopper_gpu_without_flashattention_3_kernels_runs_sdpa_and_says_why(gpu):
    gpu((9, 0))
    said = attention.choose_attention("auto", CUDA)
    assert said.startswith("PyTorch SDPA flash / memory-efficient kernels on NVIDIA H200")
    assert "FlashAttention 3 unavailable: its kernels are not in this image (module flash_attn_interface" in said
    # cuDNN's attention backward crashed FLUX.1 Kontext at 1024 px on an H200 (benchmarks/RESULTS.md).
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


@pytest.mark.parametrize("capability, reason", [
    ((9, 0), "its kernels are not in this image"),
    ((8, 0), "it needs a Hopper GPU (compute capability 9.0), this one is 8.0"),
])
def test_flash3_asked_for_where_it_cannot_run_is_refused_naming_the_field_and_the_reason(gpu, capability, reason):
    gpu(capability, name="NVIDIA A100")
    with pytest.raises(ConfigError, match=rf"^spec.training.attention: flash3 cannot run here: {re.escape(reason)}.*; "
                                          "use auto or sdpa$"):
        attention.choose_attention("flash3", CUDA)


def test_sdpa_asked_for_is_what_runs(gpu):
    gpu((9, 0))
    assert "(as asked; cuDNN attention off)" in attention.choose_attention("sdpa", CUDA)


def test_the_pypi_placeholder_package_is_told_apart_from_real_kernels(gpu, monkeypatch, tmp_path):
    # PyPI's flash-attn-interface 0.0.1 is an empty placeholder: importable, but no kernels.
    gpu((9, 0))
    (tmp_path / "flash_attn_interface").mkdir()
    (tmp_path / "flash_attn_interface" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "registers no flash_attn_3 kernels" in attention.fa3_missing(CUDA)


def test_a_cpu_run_says_so():
    assert attention.choose_attention("auto", torch.device("cpu")) == "PyTorch SDPA on the CPU"
