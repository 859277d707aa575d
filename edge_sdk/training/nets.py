"""Torch architectures that a device needs for local training (and the server too).

Torch is imported when an architecture is first asked for (a module
``__getattr__`` imports :mod:`edge_sdk.training._torch_nets`, where the classes are
defined): ``import edge_sdk.training.nets`` and :data:`BASE_LAYERS` work without it,
so a device without torch still sketches and evaluates.
:mod:`server_kit.nets` re-exports everything here and adds server-only nets.

* :class:`FCAutoencoder`: the fully connected autoencoder of Prigent et al.
  (784 -> 50 -> ReLU -> 20, decoder 20 -> 50 -> ReLU -> 784 -> Sigmoid,
  81,304 parameters, encoder 40,270); with ``FCAutoencoder(64, 48, 20)`` it
  is also the small autoencoder for scikit-learn's 8x8 digits.
* :class:`ConvAutoencoder`: the convolutional autoencoder for 32x32 RGB
  images (latent 48x4x4 = 768, 47,601 parameters).
* :class:`LeNet5`: the LeNet-5 classifier trained after clustering; it
  returns logits (no softmax inside).
* :class:`DigitsCNN`: a small classifier for 8x8 digits (logits).
* :class:`ResNet18`: ResNet-18 (:class:`BasicBlock`, [2, 2, 2, 2]) with the
  CIFAR stem for 32x32 RGB images (logits, 11,173,962 parameters for 10
  classes): the paper's CIFAR-10 and PACS classifier, which ``fedsketch
  bench`` times on the device. No shipped artifact holds its weights.
* :class:`EncoderOnly`: a wrapper that exposes an autoencoder's
  :meth:`encode` as ``forward`` for ONNX export.

Classifiers carry ``num_classes`` and ``input_shape`` (per sample, NCHW)
attributes, which :mod:`edge_sdk.training.trainer` uses to validate data.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # annotations only: torch is imported on first use
    from torch import nn

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


#: Names defined with torch in :mod:`edge_sdk.training._torch_nets`, imported on
#: first access (PEP 562 module ``__getattr__``).
_TORCH_NAMES = frozenset({
    "ARCHITECTURES", "BasicBlock", "ConvAutoencoder", "DigitsCNN", "EncoderOnly", "FCAutoencoder", "LeNet5",
    "ResNet18", "count_params",
})


def _load_torch_nets() -> ModuleType:
    """Import the torch architectures (torch with them) and bind their names here."""
    from . import _torch_nets

    globals().update({name: getattr(_torch_nets, name) for name in _TORCH_NAMES})
    return _torch_nets


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(_load_torch_nets(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Classifier architecture -> parameter-name prefixes of its "shared base":
#: the convolution layers, averaged over all sampled clients while the other
#: layers are averaged per cluster (the paper's LeNet-5 setting). Each
#: prefix ends with a dot and selects exactly one layer's weight and bias.
BASE_LAYERS: dict[str, tuple[str, ...]] = {
    "digits_cnn_1x8x8_10": ("conv1.", "conv2."),
    "lenet5_1x28x28_10": ("features.0.", "features.3."),
}


def build_model(architecture: str, registry: Mapping[str, Callable[[], nn.Module]] | None = None) -> nn.Module:
    """Instantiate a registered architecture with fresh (random) weights.

    Parameters
    ----------
    architecture : str
        A key of :data:`ARCHITECTURES`, as recorded in ``manifest.json``.
    registry : mapping, optional
        Another registry to look in (the server's adds server-only nets).

    Returns
    -------
    torch.nn.Module
        The model (full autoencoder for the ``*_ae_*`` names).

    Raises
    ------
    KeyError
        If the name is not registered.
    """
    reg = _load_torch_nets().ARCHITECTURES if registry is None else registry
    try:
        factory = reg[architecture]
    except KeyError:
        raise KeyError(f"unknown architecture {architecture!r}; known: {sorted(reg)}") from None
    return factory()
