"""Validation of FedCRef's inputs and settings: the client id, the samples, the thresholds, K, the dirtiness.

Each check returns the value it accepts and refuses anything else with a
plain-English ``ValueError`` that names the setting, its allowed values and
the paper's choice.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["check_alpha", "check_cid", "check_dirtiness", "check_k_range", "check_samples", "check_tau", "check_theta"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _in_range(value: Any, high: float, refusal: str) -> float:
    """``value`` as a float if it is a finite number in (0, ``high``]; otherwise ``ValueError(refusal)``."""
    if not _is_number(value) or not math.isfinite(float(value)) or not 0.0 < float(value) <= high:
        raise ValueError(refusal)
    return float(value)


def check_alpha(alpha: Any) -> float:
    """Validate the association percentile ``alpha`` (in (0, 100]) and return it as float."""
    return _in_range(alpha, 100.0, f"alpha must be a percentile in (0, 100] (the paper uses 75), got {alpha!r}")


def check_theta(theta: Any) -> float:
    """Validate the association threshold ``theta`` (in (0, 1]) and return it as float."""
    return _in_range(theta, 1.0, f"theta must be an association threshold in (0, 1] on normalised error "
                                 f"differences (the paper uses 0.2), got {theta!r}")


def check_tau(tau: Any) -> float:
    """Validate the stability threshold ``tau`` (in (0, 1]) and return it as float."""
    return _in_range(tau, 1.0, f"tau must be a stability threshold in (0, 1] on the clustering accuracy "
                               f"between iterations (the paper uses 0.8), got {tau!r}")


def check_k_range(k_range: Any) -> tuple[int, int]:
    """Validate a range ``(min, max)`` of cluster counts, ``2 <= min <= max``, and return it as ints."""
    try:
        lo, hi = (int(k) for k in k_range)
    except (TypeError, ValueError):
        raise ValueError(f"k_range must be a pair (min, max) of cluster counts, got {k_range!r}") from None
    if lo < 2 or hi < lo:
        raise ValueError(f"k_range must satisfy 2 <= min <= max, got {k_range!r}")
    return lo, hi


def check_dirtiness(dirtiness: Any) -> float:
    """Validate the misassignment probability of the dirty initialisation (in [0, 0.5]) and return it as float."""
    if not _is_number(dirtiness) or not 0.0 <= float(dirtiness) <= 0.5:
        raise ValueError(f"dirtiness must be a probability in [0, 0.5], got {dirtiness!r}")
    return float(dirtiness)


def check_samples(x: Any) -> np.ndarray:
    """A device's samples as ``(n, d)`` float32 once checked: floating point, at least 2 samples, in [0, 1]."""
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating) or arr.ndim < 2 or arr.shape[0] < 2:
        raise ValueError(
            f"x must be a floating-point array of at least 2 samples, shape (n, ...), got "
            f"dtype {arr.dtype} and shape {arr.shape}"
        )
    out = np.ascontiguousarray(arr.reshape(arr.shape[0], -1), dtype=np.float32)
    if not np.isfinite(out).all() or out.min() < -1e-6 or out.max() > 1 + 1e-6:
        raise ValueError("x must hold finite values in [0, 1]")
    return out


def check_cid(cid: Any) -> str:
    """Validate a client id: a non-empty string, topic-safe, without ':' (it separates node ids)."""
    if not isinstance(cid, str) or not cid or any(c in cid for c in "/+#: "):
        raise ValueError(f"cid must be a non-empty id without '/', '+', '#', ':' or spaces, got {cid!r}")
    return cid
