"""The coordinate-wise rules (Yin et al., 2018): median and trimmed mean, and their aggregator.

Unweighted, so a claimed sample count does not matter: :func:`coordinate_median`
and :func:`trimmed_mean` (``ceil(beta * n)`` values cut at each end of every
coordinate, at least one when ``n >= 3``). :class:`CoordinateAggregator`
gives them the ``add`` / ``settle`` / ``result`` interface of streaming FedAvg; integer
tensors keep their element-wise maximum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..aggregate import Refused, check_n_samples, check_update, spec_of

__all__ = ["DEFAULT_TRIM_FRACTION", "CoordinateAggregator", "coordinate_median", "trim_count", "trimmed_mean"]

Weights = Mapping[str, np.ndarray]

#: Default ``trim_fraction`` of the trimmed mean.
DEFAULT_TRIM_FRACTION: float = 0.1


def trim_count(n: int, beta: float) -> int:
    """Values cut at each end of a coordinate by the trimmed mean of ``n`` values.

    ``ceil(beta * n)``, at least 1 when ``n >= 3``, at most ``(n - 1) // 2``
    (one value at least is kept); 0 for ``n <= 2``.
    """
    if n <= 2:
        return 0
    k = max(1, math.ceil(round(beta * n, 9)))  # round: 0.1 * 30 is 3.0000000000000004
    return min(k, (n - 1) // 2)


def _stack_rule(arrays: Sequence[Weights], rule: str, beta: float) -> dict[str, np.ndarray]:
    if not arrays:
        raise ValueError(f"{rule} needs at least one update, got none")
    first = arrays[0]
    out = {}
    for name, a0 in first.items():
        a0 = np.asarray(a0)
        if not np.issubdtype(a0.dtype, np.floating):
            out[name] = np.maximum.reduce([np.asarray(a[name]) for a in arrays]).astype(a0.dtype)
            continue
        stacked = np.stack([np.asarray(a[name], dtype=np.float64) for a in arrays])
        if rule == "median":
            v = np.median(stacked, axis=0)
        else:
            k = trim_count(len(arrays), beta)
            if k:
                stacked.sort(axis=0)
                stacked = stacked[k:len(arrays) - k]
            v = stacked.mean(axis=0)
        out[name] = v.astype(a0.dtype)
    return out


def coordinate_median(updates: Sequence[Weights]) -> dict[str, np.ndarray]:
    """Coordinate-wise median of the updates (unweighted; integer tensors: the maximum).

    Parameters
    ----------
    updates : sequence of mapping of str to numpy.ndarray
        Updates with the names and shapes of the first (not checked here: see
        :class:`CoordinateAggregator`). For an even count the median is the
        mean of the two middle values.

    Returns
    -------
    dict of str to numpy.ndarray
        In the first update's dtypes.
    """
    return _stack_rule(list(updates), "median", 0.0)


def trimmed_mean(updates: Sequence[Weights], beta: float = DEFAULT_TRIM_FRACTION) -> dict[str, np.ndarray]:
    """Coordinate-wise trimmed mean (unweighted; integer tensors: the maximum).

    Every coordinate's values are sorted, :func:`trim_count` of them cut at
    each end and the rest averaged.

    Parameters
    ----------
    updates : sequence of mapping of str to numpy.ndarray
        As for :func:`coordinate_median`.
    beta : float
        The trimmed fraction per end, in (0, 0.5).

    Returns
    -------
    dict of str to numpy.ndarray
        In the first update's dtypes.
    """
    if not 0.0 < float(beta) < 0.5:
        raise ValueError(f"beta must be a number in (0, 0.5), got {beta!r}")
    return _stack_rule(list(updates), "trimmed-mean", float(beta))


class CoordinateAggregator:
    """The interface of :class:`~server_kit.aggregate.StreamingFedAvg` for the coordinate-wise rules.

    :meth:`add` checks an update as ``StreamingFedAvg.add`` does (names,
    shapes, dtype kinds, NaN or Inf, the sample count) and keeps a reference
    to its arrays; :meth:`result` applies the rule. Sample counts are
    checked and summed but do not weigh anything.

    Parameters
    ----------
    template : mapping of str to numpy.ndarray
        The model being aggregated.
    rule : {"trimmed-mean", "median"}
    trim_fraction : float
        ``beta`` of the trimmed mean.
    include : sequence of str, optional
        Aggregate only the tensors whose names start with one of these.
    """

    def __init__(self, template: Weights, rule: str, trim_fraction: float = DEFAULT_TRIM_FRACTION, *,
                 include: Sequence[str] | None = None) -> None:
        if rule not in ("trimmed-mean", "median"):
            raise ValueError(f"rule must be 'trimmed-mean' or 'median', got {rule!r}")
        full = spec_of(template, "template")
        inc = tuple(include) if include is not None else None
        self._spec = {k: v for k, v in full.items() if inc is None or k.startswith(inc)}
        if not self._spec:
            raise ValueError(f"no tensor of the template matches include={include!r}")
        self._ignored = frozenset(full) - frozenset(self._spec)
        self.rule = rule
        self.trim_fraction = float(trim_fraction)
        self._kept: list[dict[str, np.ndarray]] = []
        self.count = 0
        self.total_samples = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._spec)

    def add(self, weights: Weights, n_samples: int, *, tag: object = None) -> None:
        """Check one update and keep it; a ``ValueError`` naming the tensor refuses it (``tag``: unused)."""
        n = check_n_samples(n_samples, "update")
        arrays = check_update(weights, self._spec, "update", self._ignored)
        for name, a in arrays.items():
            if self._spec[name][2] == "f" and not np.isfinite(a).all():
                raise ValueError(f"update: tensor {name!r} contains NaN or Inf")
        self._kept.append(arrays)
        self.count += 1
        self.total_samples += n

    def settle(self) -> list[Refused]:
        """Nothing is deferred here (``add`` refuses a non-finite update at once): always ``[]``."""
        return []

    def result(self) -> dict[str, np.ndarray]:
        """The rule over the kept updates, in the template's dtypes."""
        if not self._kept:
            raise ValueError("no update was added; nothing to aggregate")
        out = _stack_rule(self._kept, self.rule, self.trim_fraction)
        return {name: out[name].astype(dtype, copy=False) for name, (_, dtype, _) in self._spec.items()}

