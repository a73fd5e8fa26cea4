"""A UNet's convolution weights go channels_last on a GPU; transformers and CPU runs stay as they are."""
from __future__ import annotations

import torch

from kubetune_trainer.training.placement import use_channels_last

GPU = torch.device("cuda", 0)  # the layout changes in place; nothing is moved, so no GPU is needed


def unet_like() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 3))


def test_a_convolutional_model_on_a_gpu_goes_channels_last():
    model = unet_like()
    assert use_channels_last(model, GPU)
    assert all(conv.weight.is_contiguous(memory_format=torch.channels_last) for conv in model[::2])


def test_a_transformer_and_a_cpu_run_keep_their_layout():
    transformer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    assert not use_channels_last(transformer, GPU)
    model = unet_like()
    assert not use_channels_last(model, torch.device("cpu"))
    assert model[0].weight.is_contiguous()
