"""One local training epoch of each architecture a device may train, timed with ``train_local``.

The epoch is :func:`edge_sdk.training.trainer.train_local` (batch 32, Adam, lr 1e-3,
the settings of a federation round) on fresh weights
(:func:`edge_sdk.training.torch_support.initial_weights`) and generated samples of the
architecture's shape. An untimed first batch pays torch's one-time costs
(thread pool, kernels for each batch shape: seen 2.3 s before a 0.15 s
DigitsCNN epoch; a two-sample step left a LeNet-5 epoch at several times its
later figure). ResNet-18 trains on fewer samples (``resnet_samples``), its
time scaled to ``samples``; its warm-up is two samples, its per-sample cost
dwarfing the one-time costs.
torch is imported here only when a row is measured; without it every row
says what to install.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Callable, Optional

import numpy as np

from ..install import install_hint
from .inputs import generated
from .results import TrainTiming

__all__ = ["ARCHITECTURES", "BATCH_SIZE", "LABELS", "LR", "time_epoch", "torch_missing", "train_rows"]

#: The architectures timed by default: the paper's two (LeNet-5, ResNet-18) and the demo's DigitsCNN.
ARCHITECTURES = ("lenet5_1x28x28_10", "digits_cnn_1x8x8_10", "resnet18_3x32x32_10")
LABELS = {"lenet5_1x28x28_10": "LeNet-5", "digits_cnn_1x8x8_10": "DigitsCNN", "resnet18_3x32x32_10": "ResNet-18"}
#: Per-sample input shapes (NCHW without the batch).
INPUT_SHAPES = {"lenet5_1x28x28_10": (1, 28, 28), "digits_cnn_1x8x8_10": (1, 8, 8),
                "resnet18_3x32x32_10": (3, 32, 32)}
#: Trained on ``resnet_samples`` only, and scaled.
SLOW = frozenset({"resnet18_3x32x32_10"})
BATCH_SIZE = 32
LR = 1e-3
NUM_CLASSES = 10


def torch_missing() -> Optional[str]:
    """None when torch imports here; otherwise the note of every training row (with what to install)."""
    if importlib.util.find_spec("torch") is None:
        return f"not measured: torch is not installed; {install_hint('train')}"
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"not measured: torch does not import ({' '.join(str(e).split())}); {install_hint('train')}"
    return None


def time_epoch(architecture: str, x: np.ndarray, y: np.ndarray, *, threads: Optional[int], seed: int,
               warmup: int = BATCH_SIZE) -> float:
    """Seconds of one ``train_local`` epoch of ``architecture`` on ``x``, ``y``, from fresh weights (needs torch).

    An untimed step on the first ``warmup`` samples runs first (0: none).
    """
    from ..training.torch_support import initial_weights
    from ..training.trainer import train_local

    weights = initial_weights(architecture, seed)
    kw = dict(epochs=1, lr=LR, batch_size=BATCH_SIZE, seed=seed, threads=threads)
    if warmup:
        train_local(architecture, weights, x[:warmup], y[:warmup], **kw)
    return float(train_local(architecture, weights, x, y, **kw).seconds)


def _threads_used(threads: Optional[int]) -> int:
    import torch

    from ..cpu import torch_threads

    chosen = torch_threads(threads)
    return int(chosen) if chosen is not None else int(torch.get_num_threads())


def train_rows(architectures: Sequence[str], *, samples: int, resnet_samples: int, threads: Optional[int],
               seed: int, progress: Callable[[str], None] = lambda line: None) -> list[TrainTiming]:
    """One :class:`TrainTiming` per architecture: measured, or saying why not (torch missing)."""
    if not architectures:
        return []
    missing = torch_missing()
    rows = []
    for arch in architectures:
        label = LABELS.get(arch, arch)
        if missing is not None:
            rows.append(TrainTiming(architecture=arch, label=label, seconds=None, samples=samples, note=missing))
            continue
        n = min(resnet_samples, samples) if arch in SLOW else samples
        progress(f"training: one epoch of {label} on {n} samples")
        x, y = generated(INPUT_SHAPES[arch], n, NUM_CLASSES, seed)
        measured = time_epoch(arch, x, y, threads=threads, seed=seed, warmup=2 if arch in SLOW else BATCH_SIZE)
        rows.append(TrainTiming(
            architecture=arch, label=label, seconds=measured * samples / n, samples=samples,
            measured_seconds=measured, measured_samples=n, threads=_threads_used(threads),
            note=f"measured on {n} samples, scaled to {samples}" if n != samples else ""))
    return rows
