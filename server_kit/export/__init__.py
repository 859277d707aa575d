"""Train and export the shipped model artifacts (ONNX + safetensors + manifest).

Run as ``python -m server_kit.export <target> [--data DIR] [--out models]
[--epochs N] [--seed S]`` (or ``fedsketch export ...``). Targets:

``fmnist-fc-ae``
    :class:`~server_kit.nets.FCAutoencoder` (784, 50, 20) trained on
    Fashion-MNIST train (``--data`` holds the IDX files), MSE, Adam lr 1e-3,
    batch 32, 20 epochs. Writes ``fmnist_fc_encoder.onnx``,
    ``fmnist_fc_ae.onnx`` and ``fmnist_fc_ae.safetensors``.
``digits-ae``
    ``FCAutoencoder(64, 48, 20)`` trained on scikit-learn's 8x8 digits with
    the four 90-degree rotations of every image. Writes
    ``digits_encoder.onnx``, ``digits_ae.onnx`` and ``digits_ae.safetensors``.
``conv-ae``
    :class:`~server_kit.nets.ConvAutoencoder` with seeded, untrained weights.
``lenet5``
    :class:`~server_kit.nets.LeNet5` with seeded initial weights (the common
    starting point of federated training).
``digits-cnn``
    :class:`~server_kit.nets.DigitsCNN` (8x8 digits classifier) with seeded
    initial weights.
``all``
    All of the above (``--data`` then applies to ``fmnist-fc-ae``).

Every ONNX file is self-contained (no external data), has a dynamic batch
dimension, and is checked against torch with onnxruntime right after it is
written. ``manifest.json`` in the output folder is updated in place: other
targets' entries are kept.

Classifier templates (``lenet5``, ``digits-cnn``) also record
``initializer_names``, a map from every ``state_dict`` key to the ONNX
initializer holding that tensor, unchanged (same shape, same values). A
device without torch evaluates received weights by overriding those
initializers in an ONNX Runtime session (:func:`edge_sdk.training.trainer.evaluate`);
the export fails if a tensor cannot be found, for example because the
exporter folded or transposed it.

The package, one job per module: :mod:`.recipes` (what each target is built
from, :func:`export_target`), :mod:`.family` (one model's files and manifest
entries), :mod:`.onnx` (torch -> ONNX and its checks), :mod:`.files`
(safetensors weights, ``manifest.json``), :mod:`.training` (the autoencoders'
training loop) and :mod:`.cli` (the command line).
"""

from __future__ import annotations

from .cli import main
from .family import export_family
from .files import (
    MANIFEST_FORMAT_VERSION,
    load_weights,
    read_manifest,
    save_weights,
    update_manifest,
)
from .onnx import OPSET, export_onnx, initializer_names, verify_onnx
from .recipes import CLASSIFIER_TARGETS, DEFAULT_EPOCHS, TARGETS, export_classifier, export_target
from .training import evaluate_mse, train_autoencoder

__all__ = [
    "CLASSIFIER_TARGETS",
    "DEFAULT_EPOCHS",
    "MANIFEST_FORMAT_VERSION",
    "OPSET",
    "TARGETS",
    "evaluate_mse",
    "export_classifier",
    "export_family",
    "export_onnx",
    "export_target",
    "initializer_names",
    "load_weights",
    "main",
    "read_manifest",
    "save_weights",
    "train_autoencoder",
    "update_manifest",
    "verify_onnx",
]
