"""LPIPS (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features as a Perceptual Metric"):
how different two images look to a trained network, 0 for the same image, larger the more they differ.

Computed here from two weight files, so nothing is downloaded and no package beyond torchvision is
needed. `kubetune evaluate --lpips-model URI` names a folder (local or s3://) holding:

- backbone.pth: torchvision's ImageNet AlexNet or VGG16 weights, a state_dict as torchvision publishes
  it (alexnet-owt-7be5be79.pth, vgg16-397923af.pth; only its `features.*` tensors are read);
- linear.pth: the LPIPS v0.1 linear-layer weights of that network as the paper's code publishes them
  (the `lpips` package's weights/v0.1/alex.pth or vgg.pth: `lin0.model.1.weight` ... `lin4...`, one
  (1, C, 1, 1) tensor per tapped layer).

Which network it is follows from linear.pth's channel counts. The distance, as the paper defines it:
both images scaled to [-1, 1], shifted and scaled per channel (the paper's scaling layer), run through
the network's convolutional stack; at each of its five tapped ReLU outputs the features are normalised
to unit length over channels, their squared difference weighted per channel by that layer's 1x1
linear layer and averaged over positions; the five layer figures summed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kubetune_trainer.errors import ConfigError

BACKBONE_FILE, LINEAR_FILE = "backbone.pth", "linear.pth"
OPTION = "--lpips-model"
EXPECTED = (f"a folder holding {BACKBONE_FILE} (torchvision's AlexNet or VGG16 state_dict) and {LINEAR_FILE} "
            "(the LPIPS v0.1 linear weights of that network, e.g. the lpips package's weights/v0.1/alex.pth)")

# The paper's scaling layer: the [-1, 1] image shifted and scaled per RGB channel.
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)


@dataclass(frozen=True)
class Network:
    """A torchvision feature stack: its layers as (kind, out channels, kernel, stride, padding), and
    the indices (in torchvision's `features` numbering) of the ReLUs whose outputs LPIPS compares."""
    name: str
    layers: tuple
    taps: tuple[int, ...]

    def channels(self) -> list[int]:
        return [self.layers[i - 1][1] for i in self.taps]


def _vgg16_layers() -> tuple:
    layers, blocks = [], [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]
    for block, (width, convolutions) in enumerate(blocks):
        for _ in range(convolutions):
            layers += [("conv", width, 3, 1, 1), ("relu", width)]
        if block < len(blocks) - 1:  # LPIPS stops at the last block's ReLU, before its pooling
            layers.append(("pool", width))
    return tuple(layers)


NETWORKS = {
    "alexnet": Network("alexnet", (
        ("conv", 64, 11, 4, 2), ("relu", 64), ("pool", 64),
        ("conv", 192, 5, 1, 2), ("relu", 192), ("pool", 192),
        ("conv", 384, 3, 1, 1), ("relu", 384),
        ("conv", 256, 3, 1, 1), ("relu", 256),
        ("conv", 256, 3, 1, 1), ("relu", 256)), taps=(1, 4, 7, 9, 11)),
    "vgg16": Network("vgg16", _vgg16_layers(), taps=(3, 8, 15, 22, 29)),
}


def _feature_stack(network: Network) -> nn.Sequential:
    """The network's `features` as torchvision lays them out, so its state_dict's keys load (AlexNet
    pools 3/2, VGG 2/2)."""
    modules, channels = [], 3
    for kind, width, *shape in network.layers:
        if kind == "conv":
            kernel, stride, padding = shape
            modules.append(nn.Conv2d(channels, width, kernel, stride, padding))
            channels = width
        elif kind == "relu":
            modules.append(nn.ReLU())
        else:
            modules.append(nn.MaxPool2d(3, 2) if network.name == "alexnet" else nn.MaxPool2d(2, 2))
    return nn.Sequential(*modules)


def _refuse(source: str, reason: str) -> ConfigError:
    return ConfigError(f"{OPTION} {source}: {reason}; expected {EXPECTED}")


def _read_state(path: Path, source: str) -> dict:
    if not path.is_file():
        raise _refuse(source, f"no {path.name} there")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: no pickled code runs
    except Exception as err:  # a file torch cannot read: whatever torch raises, the user gets one line
        raise _refuse(source, f"{path.name} is not a torch state_dict ({str(err).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _refuse(source, f"{path.name} is not a state_dict of tensors")
    return state


def _network_of(linear: dict, source: str) -> Network:
    channels = [linear.get(f"lin{i}.model.1.weight") for i in range(5)]
    if any(weight is None or weight.dim() != 4 or weight.shape[0] != 1 for weight in channels):
        raise _refuse(source, f"{LINEAR_FILE} has not the keys lin0.model.1.weight ... lin4.model.1.weight "
                              "of (1, C, 1, 1) tensors")
    found = [weight.shape[1] for weight in channels]
    for network in NETWORKS.values():
        if network.channels() == found:
            return network
    raise _refuse(source, f"{LINEAR_FILE}'s channels {found} are neither AlexNet's "
                          f"{NETWORKS['alexnet'].channels()} nor VGG16's {NETWORKS['vgg16'].channels()}")


class LpipsDistance:
    """The LPIPS network, loaded once from a local folder (evaluate's local copy of --lpips-model)."""

    def __init__(self, folder: str, device: torch.device, source: str | None = None):
        source = source or folder
        if not Path(folder).is_dir():
            raise _refuse(source, "not a directory")
        linear = _read_state(Path(folder) / LINEAR_FILE, source)
        self.network = _network_of(linear, source)
        backbone = _read_state(Path(folder) / BACKBONE_FILE, source)
        features = {key.removeprefix("features."): value for key, value in backbone.items()
                    if key.startswith("features.")}
        self.features = _feature_stack(self.network)
        try:
            self.features.load_state_dict(features)
        except RuntimeError as err:
            reason = str(err).splitlines()[0][:200]
            raise _refuse(source, f"{BACKBONE_FILE} is not torchvision's {self.network.name} "
                                  f"(its features.* do not load: {reason})") from None
        self.linear = [linear[f"lin{i}.model.1.weight"].float() for i in range(5)]
        self.features.eval().requires_grad_(False).to(device)
        self.linear = [weight.to(device) for weight in self.linear]
        self.device = device

    def _tapped(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """Each tapped ReLU's output for images in [0, 1], normalised over channels."""
        shift = torch.tensor(SHIFT, device=self.device).view(1, 3, 1, 1)
        scale = torch.tensor(SCALE, device=self.device).view(1, 3, 1, 1)
        hidden, found = (pixels * 2 - 1 - shift) / scale, []
        for index, layer in enumerate(self.features):
            hidden = layer(hidden)
            if index in self.network.taps:
                # The paper's eps keeps an all-zero feature vector (a dead ReLU position) at 0.
                found.append(hidden / (hidden.pow(2).sum(1, keepdim=True).sqrt() + 1e-10))
        return found

    @torch.no_grad()
    def distance(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """LPIPS of each pair of (N, 3, H, W) images in [0, 1] of one size: a tensor of N figures."""
        total = torch.zeros(x.shape[0], device=self.device)
        for weight, a, b in zip(self.linear, self._tapped(x.to(self.device)), self._tapped(y.to(self.device))):
            total += torch.nn.functional.conv2d((a - b) ** 2, weight).mean((1, 2, 3))
        return total.cpu()

    def scores(self, generated: Sequence, references: Sequence):
        """LPIPS of each generated PIL image with its reference (resized to the generated image's size, as
        SSIM compares them)."""
        from PIL import Image

        from kubetune_trainer.results.evaluation import Scores, _check_lengths, _pixels

        _check_lengths(generated, references)
        return Scores([float(self.distance(_pixels(image)[None],
                                           _pixels(reference.convert("RGB").resize(image.size, Image.BICUBIC))[None])[0])
                       for image, reference in zip(generated, references)])
