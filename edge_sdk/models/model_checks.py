"""Checks of what a device is handed to train or evaluate, against an architecture (numpy only).

Weights cross the trainer as plain ``{name: numpy array}`` dicts, the
``state_dict`` of the architecture (buffers included). :class:`ModelInfo`
says what an architecture expects, whether read from the torch model
(:mod:`edge_sdk.training.torch_support`) or from its shipped ONNX template
(:mod:`edge_sdk.training.evaluation`); :func:`check_weights` and :func:`check_data`
hold received weights and local samples against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..encoder import check_model_input
from .artifacts import ArtifactSpec

__all__ = ["ModelInfo", "check_data", "check_labels", "check_samples", "check_weights", "state_spec"]


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know of an architecture.

    Attributes
    ----------
    architecture : str
        Its key in :data:`edge_sdk.training.nets.ARCHITECTURES`.
    input_shape : tuple of int
        Shape of one sample (NCHW without the batch axis).
    num_classes : int
        Number of classes (0 for an autoencoder).
    spec : dict
        ``{name: (shape, dtype name)}`` of its ``state_dict``, see :func:`state_spec`.
    """

    architecture: str
    input_shape: tuple[int, ...]
    num_classes: int
    spec: dict[str, tuple[tuple[int, ...], str]]


def state_spec(weights: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of a weights dict, for validating what arrives.

    Parameters
    ----------
    weights : mapping of str to array-like
        A ``state_dict`` as numpy arrays.

    Returns
    -------
    dict
        ``{name: (shape, dtype name)}``, for example
        ``{"conv1.weight": ((16, 1, 3, 3), "float32"), ...}``, in the order of
        ``weights``.
    """
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, value in weights.items():
        a = np.asarray(value)
        out[str(name)] = (tuple(int(d) for d in a.shape), a.dtype.name)
    return out


def _check_names(info: ModelInfo, weights: Mapping[str, Any]) -> None:
    """Refuse a non-mapping, or missing or unexpected tensor names."""
    if not isinstance(weights, Mapping):
        raise ValueError(
            f"weights must be a mapping of tensor names to arrays, got {type(weights).__name__}"
        )
    missing = [k for k in info.spec if k not in weights]
    unexpected = sorted(str(k) for k in weights if k not in info.spec)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        raise ValueError(
            f"weights do not match architecture {info.architecture!r}: {'; '.join(parts)}"
        )


def check_weights(info: ModelInfo, weights: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Check names, shapes, dtypes and finiteness against the architecture; return arrays.

    Parameters
    ----------
    info : ModelInfo
        The architecture.
    weights : mapping of str to array-like
        Received weights; not modified.

    Returns
    -------
    dict of str to numpy.ndarray
        C-contiguous, writeable arrays in the architecture's dtypes and order.

    Raises
    ------
    ValueError
        On a name, shape or dtype that does not match, or NaN or Inf.
    """
    _check_names(info, weights)
    out: dict[str, np.ndarray] = {}
    for name, (shape, dtype) in info.spec.items():
        a = np.asarray(weights[name])
        if a.shape != shape:
            raise ValueError(
                f"weights[{name!r}] has shape {a.shape}; architecture {info.architecture!r} "
                f"expects {shape}"
            )
        want = np.dtype(dtype)
        if np.issubdtype(want, np.floating):
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(
                    f"weights[{name!r}] has dtype {a.dtype}; expected a floating-point array"
                )
            if not np.isfinite(a).all():
                raise ValueError(f"weights[{name!r}] contains NaN or Inf")
        elif not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"weights[{name!r}] has dtype {a.dtype}; expected integers ({want})")
        arr = np.asarray(a, dtype=want, order="C")  # (ascontiguousarray would make 0-d 1-d)
        # torch.from_numpy warns on read-only arrays (as decoded from a payload): copy those
        out[name] = arr if arr.flags.writeable else arr.copy()
    return out


def check_samples(info: ModelInfo, x: Any) -> np.ndarray:
    """Validate samples for a classifier: writeable float32 ``(n, *input_shape)``, at least one, in [0, 1].

    Single-channel images may omit the channel axis. ValueError names what is wrong.
    """
    shape = info.input_shape
    spec = ArtifactSpec(
        name=info.architecture,
        file="",
        sha256="",
        role="classifier",
        input_shape=shape,
        # a single-channel model also takes (n, H, W) images
        image_shape=shape[1:] if len(shape) > 1 and shape[0] == 1 else None,
        input_range=(0.0, 1.0),
    )
    xa = check_model_input(x, spec, "x")
    if not xa.flags.writeable:  # see check_weights
        xa = xa.copy()
    if xa.shape[0] == 0:
        raise ValueError("x holds no samples")
    return xa


def check_labels(info: ModelInfo, y: Any, n: int) -> np.ndarray:
    """Validate ``n`` integer class labels for a classifier: int64 ``(n,)`` in ``[0, num_classes)``."""
    ya = np.asarray(y)
    if ya.ndim != 1 or ya.shape[0] != n:
        raise ValueError(f"y has shape {ya.shape}; expected ({n},), one label per sample of x")
    if not np.issubdtype(ya.dtype, np.integer):
        raise ValueError(f"y must hold integer class labels, got dtype {ya.dtype}")
    lo, hi = int(ya.min()), int(ya.max())
    if lo < 0 or hi >= info.num_classes:
        raise ValueError(
            f"labels must lie in [0, {info.num_classes - 1}] for {info.architecture!r}, "
            f"got values in [{lo}, {hi}]"
        )
    return ya.astype(np.int64)


def check_data(info: ModelInfo, x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate samples and labels for a classifier.

    Parameters
    ----------
    info : ModelInfo
        The classifier.
    x : array-like
        Samples in [0, 1], ``(n, *input_shape)``; single-channel images may
        omit the channel axis.
    y : array-like
        Integer labels ``(n,)`` in ``[0, num_classes)``.

    Returns
    -------
    tuple of numpy.ndarray
        Writeable float32 ``(n, *input_shape)`` samples and int64 ``(n,)`` labels.

    Raises
    ------
    ValueError
        On a wrong shape, dtype or range, NaN or Inf, no samples, or labels
        out of range.
    """
    xa = check_samples(info, x)
    return xa, check_labels(info, y, xa.shape[0])
