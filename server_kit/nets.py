"""Torch architectures used by FedSketch, for the server's code: the edge's registry, re-exported.

Every architecture a device trains or embeds, ResNet-18 at 32x32x3 included
(:class:`ResNet18`: basic blocks [2, 2, 2, 2], the CIFAR stem; 11,173,962
parameters for 10 classes), lives in :mod:`edge_sdk.training.nets`; the server's
modules import them from here. :data:`ARCHITECTURES` and
:func:`build_model` are the edge's own.
"""

from __future__ import annotations

from edge_sdk.training.nets import (
    ARCHITECTURES,
    BASE_LAYERS,
    BasicBlock,
    ConvAutoencoder,
    DigitsCNN,
    EncoderOnly,
    FCAutoencoder,
    LeNet5,
    ResNet18,
    build_model,
    count_params,
)

__all__ = [
    "ARCHITECTURES",
    "BASE_LAYERS",
    "BasicBlock",
    "ConvAutoencoder",
    "DigitsCNN",
    "EncoderOnly",
    "FCAutoencoder",
    "LeNet5",
    "ResNet18",
    "build_model",
    "count_params",
]
