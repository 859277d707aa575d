"""The checks of :class:`~server_kit.clustering.sketch.SketchClustering`'s settings and input sketches."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from edge_sdk.validation import check_choice, check_int

from .threshold import ACQ_FUNCS

__all__ = ["PARAM_NAMES", "check_packed", "check_params"]

#: The estimator's constructor arguments, in order (``get_params``).
PARAM_NAMES = (
    "min_cluster_size", "n_calls", "n_initial_points", "acq_func", "kappa",
    "threshold_range", "single_cluster_alpha", "n_null", "null_max_clients",
    "refine", "max_depth", "min_separation", "consolidate", "max_exact_clients", "block_bits", "noise_clip",
    "random_state",
)  # fmt: skip


def check_params(model: Any) -> None:
    """Refuse a bad setting of ``model`` (a ``SketchClustering``) with a ValueError naming it."""
    check_int(model.min_cluster_size, "min_cluster_size", 1)
    check_int(model.n_calls, "n_calls", 1)
    check_int(model.max_depth, "max_depth", 0)
    if not isinstance(model.refine, (bool, np.bool_)):
        raise ValueError(f"refine must be True or False, got {model.refine!r}")
    check_int(model.n_initial_points, "n_initial_points", 1)
    if model.n_initial_points > model.n_calls:
        raise ValueError(
            f"n_initial_points must be at most n_calls ({model.n_calls}), "
            f"got {model.n_initial_points}"
        )
    check_choice(model.acq_func, "acq_func", ACQ_FUNCS, ACQ_FUNCS)
    kappa = model.kappa
    if (
        isinstance(kappa, bool)
        or not isinstance(kappa, numbers.Real)
        or not kappa >= 0
        or not np.isfinite(kappa)
    ):
        raise ValueError(f"kappa must be a finite number >= 0, got {kappa!r}")
    _check_threshold_range(model.threshold_range)
    _check_null_test(model.single_cluster_alpha, model.n_null, model.null_max_clients)
    sep = model.min_separation
    if sep is not None and (isinstance(sep, bool) or not isinstance(sep, numbers.Real)
                            or not 0 <= sep < np.inf):
        raise ValueError(f"min_separation must be None or a finite number >= 0, got {sep!r}")
    check_int(model.consolidate, "consolidate", 0)
    if model.max_exact_clients is not None:
        check_int(model.max_exact_clients, "max_exact_clients", 100)
    if model.block_bits is None and model.noise_clip is not None:
        raise ValueError(f"noise_clip needs block_bits (the bits of one class block), got noise_clip={model.noise_clip!r}")
    if model.block_bits is not None:
        check_int(model.block_bits, "block_bits", 1)
    if model.noise_clip is not None:
        check_int(model.noise_clip, "noise_clip", 1)


def _check_threshold_range(rng_: Any) -> None:
    if rng_ is not None:
        ok = isinstance(rng_, (tuple, list)) and len(rng_) == 2
        ok = ok and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in rng_)
        if not ok or not (0 < rng_[0] < rng_[1] < np.inf):
            raise ValueError(
                f"threshold_range must be None or a pair (low, high) with 0 < low < high, got {rng_!r}"
            )


def _check_null_test(alpha: Any, n_null: Any, null_max_clients: Any) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < 1:
        raise ValueError(f"single_cluster_alpha must be a number in (0, 1), got {alpha!r}")
    check_int(n_null, "n_null", 0)
    if n_null and (n_null + 1) * alpha < 1 - 1e-9:
        need = int(np.ceil(1 / alpha - 1 - 1e-9))
        raise ValueError(
            f"n_null must be 0 (no test) or at least {need} for single_cluster_alpha={alpha}: "
            f"the smallest p-value is 1 / (n_null + 1), got n_null={n_null}"
        )
    check_int(null_max_clients, "null_max_clients", 10)


def check_packed(packed: Any, n_bits: int | None) -> np.ndarray:
    """``packed`` as a C-contiguous 2-D uint8 array of ``ceil(n_bits / 8)`` bytes a row, or a ValueError."""
    p = np.asarray(packed)
    if p.dtype != np.uint8 or p.ndim != 2:
        raise ValueError(
            f"packed must be a 2-D uint8 array (clients x bytes), got {p.dtype} {p.shape}"
        )
    if n_bits is not None:
        need = (n_bits + 7) // 8
        if p.shape[1] != need:
            raise ValueError(f"packed rows hold {p.shape[1]} bytes; {n_bits} bits need {need}")
    return np.ascontiguousarray(p)
