"""Attention as a fused kernel stores it for backward, during a memory estimate.

On a GPU, scaled_dot_product_attention runs a flash or memory-efficient kernel: it keeps q, k,
v, the output and a per-row logsumexp for backward (plus the mask, if any), never the L x L
attention matrix, which backward recomputes in tiles. Fake CUDA tensors cannot pick that kernel
(choosing one queries the device), and the math fallback would save the full matrix and make
every estimate quadratic in the number of tokens. So during estimation every call goes through
`FusedAttentionSaves`, which stores what the fused kernels store.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class FusedAttentionSaves(torch.autograd.Function):
    """Shapes-only attention whose saved tensors are the fused kernels' (only used on fake tensors)."""

    @staticmethod
    def forward(ctx, query, key, value, mask):
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value = ctx.saved_tensors[:3]
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), None


def _sdpa_arguments(query, key, value, attn_mask=None, *_, **__):
    """scaled_dot_product_attention's tensors however they were passed (positionally or by name)."""
    return query, key, value, attn_mask


class _FusedAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, mask = _sdpa_arguments(*args, **kwargs)
        device = query.device.type
        if torch.is_autocast_enabled(device):  # autocast runs attention in the low precision
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return FusedAttentionSaves.apply(query, key, value, mask)


KERNELS = ("fused", "math")


@contextmanager
def attention_kernel(kind: str):
    """Within: attention saves what a fused kernel saves ("fused": flash / memory-efficient on a GPU,
    and torch's flash kernel for the CPU), or what the math kernel saves ("math": the softmaxed
    L x L matrix too, e.g. for attention masks no fused kernel takes)."""
    if kind == "fused":
        with _FusedAttention():
            yield
    elif kind == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            yield
    else:
        raise ValueError(f"attention kernel {kind!r}: use one of {', '.join(KERNELS)}")
