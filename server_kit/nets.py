"""Torch architectures used by FedSketch: the edge's, re-exported, plus server-only nets.

The architectures a device trains or embeds (:class:`FCAutoencoder`,
:class:`ConvAutoencoder`, :class:`LeNet5`, :class:`DigitsCNN`,
:class:`EncoderOnly`) live in :mod:`edge_sdk.nets` and are re-exported here
under their old names. This module adds the nets only the server runs:

* :class:`ResNet18`: ResNet-18 (basic blocks, [2, 2, 2, 2]) with the CIFAR
  stem (3x3 convolution, stride 1, no max-pooling) for 32x32 images;
  11,173,962 parameters for 10 classes. Used by the aggregation benchmark
  and by the CIFAR-10 scenario, where clusters are trained fully separately.

:data:`ARCHITECTURES` here is the edge registry extended with the server-only
names; :func:`build_model` builds any of them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from edge_sdk.nets import ARCHITECTURES as EDGE_ARCHITECTURES
from edge_sdk.nets import (
    BASE_LAYERS,
    ConvAutoencoder,
    DigitsCNN,
    EncoderOnly,
    FCAutoencoder,
    LeNet5,
    count_params,
)
from edge_sdk.nets import build_model as _edge_build_model

__all__ = [
    "ARCHITECTURES",
    "BASE_LAYERS",
    "BasicBlock",
    "ConvAutoencoder",
    "DigitsCNN",
    "EDGE_ARCHITECTURES",
    "EncoderOnly",
    "FCAutoencoder",
    "LeNet5",
    "ResNet18",
    "build_model",
    "count_params",
]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity (or 1x1) shortcut.

    Parameters
    ----------
    c_in, c_out : int
        Input and output channels.
    stride : int
        Stride of the first convolution (2 halves height and width); the
        shortcut becomes a strided 1x1 convolution with BatchNorm whenever
        the shape changes.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for small images, returning logits.

    Stem Conv(3x3, stride 1) -> BatchNorm -> ReLU with 64 channels, four
    stages of two :class:`BasicBlock` each (64, 128, 256, 512 channels; the
    last three start with stride 2), global average pooling and one linear
    layer. For 32x32 inputs the last feature map is 4x4.

    Parameters
    ----------
    num_classes : int
        Number of output logits.
    in_channels : int
        Image channels.
    """

    stage_channels = (64, 128, 256, 512)
    blocks_per_stage = (2, 2, 2, 2)

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        self.in_channels = int(in_channels)
        self.input_shape = (self.in_channels, 32, 32)
        c0 = self.stage_channels[0]
        self.conv1 = nn.Conv2d(self.in_channels, c0, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c0)
        self.relu = nn.ReLU(inplace=True)
        stages: list[nn.Module] = []
        c_in = c0
        for i, (c_out, n_blocks) in enumerate(zip(self.stage_channels, self.blocks_per_stage)):
            blocks = [BasicBlock(c_in, c_out, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(c_out, c_out) for _ in range(n_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            c_in = c_out
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, num_classes)`` of images ``(batch, C, H, W)``."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


#: Architecture name -> constructor: the edge registry plus the server-only nets.
ARCHITECTURES: dict[str, Callable[[], nn.Module]] = {
    **EDGE_ARCHITECTURES,
    "resnet18_3x32x32_10": lambda: ResNet18(10, 3),
}


def build_model(architecture: str) -> nn.Module:
    """Instantiate a registered architecture (edge or server-only) with fresh weights.

    See :func:`edge_sdk.nets.build_model`; this one also knows the server-only nets.
    """
    return _edge_build_model(architecture, ARCHITECTURES)
