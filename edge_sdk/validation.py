"""Checks of single settings, with one wording everywhere: ``check(value, name, ...) -> the clean value``.

Every module of both packages validates its numbers through these (before,
eleven private copies with three argument orders). A bool is never a number
here, numpy integers and floats are, and every message names the setting and
quotes the value it got.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["check_choice", "check_int", "check_number", "check_positive", "check_positive_int"]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``: ``"{name} must be an integer >= {minimum}, got {value!r}"``."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1: ``"{name} must be a positive integer, got {value!r}"``."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_positive(value: Any, name: str, unit: str = "number") -> float:
    """``value`` as a finite float > 0: ``"{name} must be a positive {unit}, got {value!r}"``."""
    if (not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_))
            or not math.isfinite(float(value)) or float(value) <= 0.0):
        raise ValueError(f"{name} must be a positive {unit}, got {value!r}")
    return float(value)


def check_number(value: Any, name: str, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> float:
    """``value`` as a finite float within the bounds, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    v = float(value)
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return v


def check_choice(value: Any, name: str, choices: Any, shown: Any = None) -> Any:
    """``value`` if it is one of ``choices``, or ``ValueError("<name> must be one of <shown>, got <value>")``.

    ``shown`` is how the message writes the choices (default ``list(choices)``).
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices) if shown is None else shown}, got {value!r}")
    return value
