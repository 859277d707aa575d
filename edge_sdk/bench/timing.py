"""Timing small and large calls alike: a calibrated loop per repeat, the median over repeats."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Callable

__all__ = ["measure", "median", "percentile"]

#: A repeat runs its call in a loop until it lasts at least this long, so that a 10 us kernel is timed
#: over many calls rather than near the clock's resolution.
MIN_REPEAT_S = 0.002
#: Most calls in one repeat's loop.
MAX_LOOPS = 10_000


def measure(fn: Callable[[], object], repeats: int, *, warmup: bool = True,
            min_repeat_s: float = MIN_REPEAT_S) -> list[float]:
    """Seconds per call of ``fn()``, once per repeat.

    One untimed call first (``warmup``: ONNX Runtime and numpy allocate on
    their first call), then a timed call that sets how many calls each repeat
    loops over (enough to last ``min_repeat_s``, at most :data:`MAX_LOOPS`).

    Parameters
    ----------
    fn : callable
        The call to time, without arguments.
    repeats : int
        How many per-call figures to return.
    warmup : bool
        Make one untimed call first.
    min_repeat_s : float
        Shortest repeat: faster calls are looped.

    Returns
    -------
    list of float
        ``repeats`` figures, seconds per call.
    """
    if warmup:
        fn()
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    loops = 1 if first >= min_repeat_s else min(MAX_LOOPS, math.ceil(min_repeat_s / max(first, 1e-9)))
    out = []
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        out.append((time.perf_counter() - t0) / loops)
    return out


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (the mean of the middle two for an even count)."""
    v = sorted(values)
    if not v:
        raise ValueError("median of no values")
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values``, linearly interpolated (numpy's default)."""
    v = sorted(values)
    if not v:
        raise ValueError("percentile of no values")
    pos = (len(v) - 1) * float(q) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
