"""device_copy.to_device: a host-to-GPU copy is staged in pinned memory and queued, not waited for."""
from __future__ import annotations

import torch

from kubetune_trainer.training.device_copy import to_device


class RecordingTensor:
    """Stands in for a CPU tensor (this machine has no GPU): records how it is moved."""

    def __init__(self, calls: list, device: str = "cpu"):
        self.calls, self.device = calls, torch.device(device)

    def pin_memory(self):
        self.calls.append("pin_memory")
        return RecordingTensor(self.calls)

    def to(self, *args, **kwargs):
        self.calls.append(("to", args, kwargs))
        return RecordingTensor(self.calls, "cuda")


def test_a_copy_to_a_gpu_goes_through_pinned_memory_without_blocking():
    calls = []
    to_device(RecordingTensor(calls), "cuda:0", torch.bfloat16)
    assert calls == ["pin_memory", ("to", ("cuda:0",), {"non_blocking": True}),
                     ("to", (), {"device": "cuda:0", "dtype": torch.bfloat16})]


def test_a_tensor_already_on_the_gpu_is_not_pinned_again():
    calls = []
    to_device(RecordingTensor(calls, "cuda"), torch.device("cuda"))
    assert calls == [("to", (), {"device": torch.device("cuda"), "dtype": None})]


def test_on_the_cpu_it_is_tensor_to_with_the_same_values():
    drawn = torch.randn(3, 4)
    moved = to_device(drawn, "cpu", torch.float64)
    assert moved.dtype == torch.float64 and moved.device.type == "cpu"
    assert torch.equal(moved, drawn.double())
    assert to_device(drawn, torch.device("cpu")) is drawn  # nothing to do: no copy, no pinning (no GPU here)
