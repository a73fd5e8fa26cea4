"""The per-parameter memory rules and Kubernetes quantities, shared by `kubetune plan` and the operator."""
from __future__ import annotations

import pytest

from kubetune_api.memory_rules import optimizer_state_bytes, optimizer_step_bytes
from kubetune_api.quantity import parse_quantity

MILLION = 10**6


@pytest.mark.parametrize("optimizer, numel, param_bytes, expected", [
    ("adamw", MILLION, 4, 8 * MILLION),                       # m and v in fp32
    ("lion", MILLION, 4, 4 * MILLION),                        # m only
    ("prodigy", MILLION, 4, 16 * MILLION),                    # s, p0, m, v
    ("schedulefree-adamw", MILLION, 4, 8 * MILLION),          # z and v
    ("sgd", MILLION, 4, 4 * MILLION),                         # momentum 0.9 by default
    ("adamw8bit", MILLION, 4, 2.03125 * MILLION),             # two uint8 states + fp32 block scales
    ("adamw8bit", 2560, 4, 8 * 2560),                         # below 4096 elements: 32-bit states
])
def test_optimizer_state_per_trained_tensor(optimizer, numel, param_bytes, expected):
    assert optimizer_state_bytes(optimizer, numel, param_bytes) == pytest.approx(expected)


def test_sgd_without_momentum_keeps_no_state():
    assert optimizer_state_bytes("sgd", MILLION, 4, sgd_momentum=0.0) == 0


def test_an_optimizer_without_a_rule_is_named():
    with pytest.raises(ValueError, match="spec.training.optimizer: no memory rule for 'adafactor'; known: adamw"):
        optimizer_state_bytes("adafactor", 10, 4)


@pytest.mark.parametrize("optimizer, on_gpu, expected", [
    ("adamw", True, 400),     # foreach: sqrt(v) of every tensor at once
    ("adamw", False, 20),     # the CPU loops tensor by tensor
    ("lion", True, 20),
])
def test_optimizer_step_temporaries(optimizer, on_gpu, expected):
    assert optimizer_step_bytes(optimizer, trained_bytes=400, largest_tensor_bytes=10, on_gpu=on_gpu) == expected


@pytest.mark.parametrize("text, expected", [
    ("80Gi", 80 * 2**30), ("81920Mi", 80 * 2**30), ("40G", 40 * 10**9), ("1.5Gi", 3 * 2**29), ("1024", 1024),
])
def test_quantities_in_bytes(text, expected):
    assert parse_quantity(text, "spec.resources.gpuMemory") == expected


@pytest.mark.parametrize("text", ["80GB", "eighty", "-1Gi", "500m", ""])
def test_a_bad_quantity_names_the_field_and_the_forms(text):
    with pytest.raises(ValueError, match=r"spec.resources.gpuMemory: .* is not a memory size; write a Kubernetes "
                                         r"quantity such as 80Gi, 81920Mi or 85G"):
        parse_quantity(text, "spec.resources.gpuMemory")
