"""What a training run keeps in memory per parameter: one set of rules, torch-free.

`kubetune plan` (kubetune_trainer.planning, which builds the real models on the meta device)
and the operator's coarse fit check (kubetune_api.fit, which cannot import torch) both count
bytes with these functions, so the two never disagree about what an optimizer or a quantized
base costs.
"""
from __future__ import annotations

GIB = 2**30

# Bytes per weight in each spec.training.mixedPrecision: frozen weights load in it.
PRECISION_BYTES = {"no": 4, "bf16": 2, "fp16": 2}
TRAINED_WEIGHT_BYTES = 4  # trained weights (LoRA or full) stay fp32, as the trainer keeps them

# The frozen denoiser's Linear weights under spec.model.quantization: nf4 packs two 4-bit codes
# per byte plus one fp32 scale per 64-weight block (bitsandbytes' default block size); fp8 is
# one byte per weight (torchao float8, dequantized one layer at a time to compute).
QUANTIZED_LINEAR_BYTES = {"nf4": 0.5 + 4 / 64, "fp8": 1.0}

# Optimizer state per trained parameter, in copies of the parameter (states take its dtype):
# AdamW m and v; Prodigy s, p0, m and v; Lion m; schedule-free AdamW z and v; SGD its momentum.
STATE_COPIES = {"adamw": 2, "prodigy": 4, "lion": 1, "schedulefree-adamw": 2, "sgd": 1}

# bitsandbytes' 8-bit AdamW: two uint8 states plus an fp32 scale per 256-element block each;
# tensors under 4096 elements (min_8bit_size) keep two 32-bit states instead.
ADAMW8BIT_MIN_SIZE = 4096
ADAMW8BIT_BYTES = 2 + 2 * 4 / 256

EMA_BYTES = 4  # the average is one fp32 copy of the trained parameters

# CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's slack: what nvidia-smi shows
# beyond the tensors. A round figure for one process on a current data-centre GPU.
CUDA_OVERHEAD_BYTES = int(1.0 * GIB)


def optimizer_state_bytes(optimizer: str, numel: int, param_bytes: int, sgd_momentum: float = 0.9) -> float:
    """Bytes of optimizer state one trained tensor of `numel` elements (each `param_bytes`) keeps."""
    if optimizer == "adamw8bit":
        return numel * (ADAMW8BIT_BYTES if numel >= ADAMW8BIT_MIN_SIZE else 2 * param_bytes)
    if optimizer == "sgd" and sgd_momentum == 0:
        return 0
    if optimizer not in STATE_COPIES:
        raise ValueError(f"spec.training.optimizer: no memory rule for {optimizer!r}; "
                         f"known: {', '.join([*STATE_COPIES, 'adamw8bit'])}")
    return numel * param_bytes * STATE_COPIES[optimizer]


def optimizer_step_bytes(optimizer: str, trained_bytes: int, largest_tensor_bytes: int, on_gpu: bool) -> int:
    """Temporaries of one optimizer step: torch's AdamW on a GPU (foreach) builds sqrt(v) for every
    tensor at once, one more copy of the trained weights; per-tensor loops need ~2 of the largest."""
    if optimizer == "adamw" and on_gpu:
        return trained_bytes
    return 2 * largest_tensor_bytes
