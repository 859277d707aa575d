"""What a fit leaves on a :class:`~server_kit.clustering.sketch.SketchClustering`: its fitted attributes, its log line.

:func:`start_fit` resets the attributes that every exact fit sets;
:func:`finish_single` (one cluster, and why) and :func:`finish_several` (the
chosen partition) set the labels, the cluster count, the centroids and the CH
score; :func:`log_fit` logs the fit's one summary line: the probes, the
threshold, k, CH, the permutation test, the verdict and the time.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from .dendrogram import calinski_harabasz_bits, cluster_sums

__all__ = ["finish_several", "finish_single", "log_fit", "start_fit"]

# the estimator's one logger: a refinement quiets it (QuietLogger) while its children fit
log = logging.getLogger("server_kit.clustering.sketch")


def start_fit(model: Any, n_bits: int) -> None:
    """Reset the fitted attributes that every exact fit sets."""
    model.n_bits_ = n_bits
    model.search_ = []
    model.threshold_range_ = None
    model.max_ch_ = 0.0
    model.null_ch_ = np.empty(0)
    model.null_observed_ch_ = None
    model.null_pvalue_ = None
    model.refinements_ = []
    model.consolidated_ = 0


def finish_several(model: Any, bits: np.ndarray, labels: np.ndarray, t0: float) -> Any:
    """Set the fitted attributes of the final partition ``labels`` (several clusters)."""
    k = int(labels.max()) + 1
    model.labels_ = labels
    model.n_clusters_ = k
    sums, counts = cluster_sums(bits, labels, k)
    model.centroids_ = sums / counts[:, None]
    model.ch_score_ = calinski_harabasz_bits(bits, labels)
    log_fit(model, t0, "several clusters")
    return model


def finish_single(model: Any, bits: np.ndarray, reason: str, t0: float) -> Any:
    """Set the fitted attributes of one cluster, for ``reason``."""
    n = bits.shape[0]
    model.labels_ = np.zeros(n, dtype=np.intp)
    model.n_clusters_ = 1
    model.threshold_ = float(model.linkage_[-1, 2]) if n > 1 else 0.0
    model.ch_score_ = None
    model.centroids_ = bits.mean(axis=0, dtype=np.float64)[None, :]
    log_fit(model, t0, f"one cluster ({reason})")
    return model


def log_fit(model: Any, t0: float, verdict: str) -> None:
    """Log the fit's summary line (at INFO), ``verdict`` and the seconds since ``t0`` included."""
    n_valid = sum(1 for s in model.search_ if s["valid"])
    ch = "n/a" if model.ch_score_ is None else f"{model.ch_score_:.4g}"
    if model.null_pvalue_ is None:
        null = "null test not run"
    else:
        null = (f"null test: observed {model.null_observed_ch_:.4g} vs null max {model.null_ch_.max():.4g} "
                f"over {model.null_ch_.size} permutations, p = {model.null_pvalue_:.3g}")
    log.info(
        "%d clients: %d probes (%d admissible), threshold %.4g -> k = %d, CH %s; %s; %s (%.3f s)",
        model.labels_.size, len(model.search_), n_valid, model.threshold_, model.n_clusters_, ch, null,
        verdict, time.perf_counter() - t0,
    )
