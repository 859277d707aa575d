"""FedAvg's numpy reference, whole (:func:`fedavg`) or one update at a time (:class:`RunningMean`), and the checks
every update of a model passes (:func:`spec_of`, :func:`check_update`, :func:`check_n_samples`).

Both sum ``n_i * w_i`` in float64 and divide by the total at the end; integer tensors (BatchNorm's
``num_batches_tracked``) keep their element-wise maximum. :mod:`server_kit.aggregate` builds its streaming
accumulator on the same checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["RunningMean", "check_n_samples", "check_update", "fedavg", "spec_of"]

Weights = Mapping[str, np.ndarray]


def check_n_samples(n_samples: Any, what: str) -> int:
    """A sample count (an update's weight) as a non-negative int, or a ValueError naming ``what``."""
    if isinstance(n_samples, bool) or not isinstance(n_samples, (int, np.integer)) or n_samples < 0:
        raise ValueError(f"{what}: n_samples must be a non-negative integer, got {n_samples!r}")
    return int(n_samples)


def _kind(dtype: np.dtype, name: str, what: str) -> str:
    """``"f"`` for floating, ``"i"`` for integer tensors; anything else is refused."""
    if np.issubdtype(dtype, np.floating):
        return "f"
    if np.issubdtype(dtype, np.integer):
        return "i"
    raise ValueError(f"{what}: tensor {name!r} has dtype {dtype}; expected floating or integer")


_Spec = tuple[tuple[int, ...], np.dtype, str]


def spec_of(weights: Weights, what: str) -> dict[str, _Spec]:
    """Name -> (shape, kind) of a model's tensors: what every update of it must match."""
    if not isinstance(weights, Mapping):
        raise ValueError(
            f"{what} must be a mapping of tensor names to arrays, got {type(weights).__name__}"
        )
    out = {}
    for name, value in weights.items():
        a = np.asarray(value)
        out[name] = (a.shape, a.dtype, _kind(a.dtype, name, what))
    return out


def check_update(
    weights: Weights, spec: Mapping[str, _Spec], what: str, ignored: Iterable[str] = ()
) -> dict[str, np.ndarray]:
    """Arrays of ``weights`` for the names of ``spec``, checked; ``ignored`` names may be present."""
    if not isinstance(weights, Mapping):
        raise ValueError(
            f"{what}: weights must be a mapping of tensor names to arrays, got {type(weights).__name__}"
        )
    skip = set(ignored)
    for name in weights:
        if name not in spec and name not in skip:
            raise ValueError(f"{what}: unexpected tensor {name!r} (not in the template)")
    out = {}
    for name, (shape, _dtype, kind) in spec.items():
        if name not in weights:
            raise ValueError(f"{what}: tensor {name!r} is missing")
        a = np.asarray(weights[name])
        if a.shape != shape:
            raise ValueError(f"{what}: tensor {name!r} has shape {a.shape}, expected {shape}")
        if _kind(a.dtype, name, what) != kind:
            expected = "floating" if kind == "f" else "integer"
            raise ValueError(f"{what}: tensor {name!r} has dtype {a.dtype}, expected {expected}")
        out[name] = a
    return out


def fedavg(updates: Sequence[tuple[Weights, int]]) -> dict[str, np.ndarray]:
    """Weighted average of model updates (the numpy reference).

    Parameters
    ----------
    updates : sequence of (weights, n_samples)
        Every update as a ``{name: array}`` dict and its sample count (a
        non-negative integer). All updates must have the names, shapes and
        dtype kinds of the first one.

    Returns
    -------
    dict of str to numpy.ndarray
        ``sum(n_i * w_i) / sum(n_i)`` per floating tensor, accumulated in
        float64 and returned in the first update's dtype; the element-wise
        maximum for integer tensors.

    Raises
    ------
    ValueError
        On no updates, a zero total weight, a negative or non-integer count,
        mismatched names, shapes or dtype kinds, or NaN or Inf.
    """
    updates = list(updates)
    if not updates:
        raise ValueError("fedavg needs at least one update, got none")
    for i, item in enumerate(updates):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"update {i} must be a (weights, n_samples) pair")
    mean = RunningMean(updates[0][0], "update 0")
    for i, (weights, n) in enumerate(updates):
        mean.add(weights, n, f"update {i}")
    return mean.result()


class RunningMean:
    """:func:`fedavg`'s arithmetic, one update at a time: ``sum(n_i * w_i)`` in float64, divided at the end.

    What needs only one update in memory at a time (an aggregator reading updates it kept on disk) gets
    exactly :func:`fedavg`'s result: the same sums, in the same order per element.

    Parameters
    ----------
    template : mapping of str to numpy.ndarray
        The first update, or the model (its names, shapes and dtype kinds; values not kept).
    what : str
        How errors name the template.
    """

    def __init__(self, template: Weights, what: str = "template") -> None:
        self._spec = spec_of(template, what)
        self._sums = {name: np.zeros(shape, dtype=np.float64)
                      for name, (shape, _, kind) in self._spec.items() if kind == "f"}
        self._maxima: dict[str, np.ndarray] = {}
        self.count = 0
        self.total_samples = 0

    def add(self, weights: Weights, n_samples: Any, what: str = "update") -> None:
        """Check one update (names, shapes, kinds, finite) and add ``n_samples * weights``; nothing on error."""
        n = check_n_samples(n_samples, what)
        arrays = check_update(weights, self._spec, what)
        for name, a in arrays.items():
            if name in self._sums and not np.isfinite(a).all():
                raise ValueError(f"{what}: tensor {name!r} contains NaN or Inf")
        for name, a in arrays.items():
            if name in self._sums:
                self._sums[name] += np.asarray(a, dtype=np.float64) * n
            elif name in self._maxima:
                np.maximum(self._maxima[name], a, out=self._maxima[name])
            else:
                self._maxima[name] = np.array(a, copy=True)
        self.count += 1
        self.total_samples += n

    def result(self) -> dict[str, np.ndarray]:
        """The weighted mean of the updates added (floating tensors), the element-wise maximum (integer ones)."""
        if self.count == 0:
            raise ValueError("fedavg needs at least one update, got none")
        if self.total_samples == 0:
            raise ValueError("total weight is zero: every update has n_samples == 0")
        out = {}
        for name, (_, dtype, kind) in self._spec.items():
            if kind == "f":
                out[name] = (self._sums[name] / self.total_samples).astype(dtype)
            else:
                out[name] = self._maxima[name].astype(dtype)
        return out
