"""Large fleets: cluster a seeded sample with the full method, assign every client to its nearest centroid.

Past :data:`MAX_EXACT_CLIENTS` the pairwise distances no longer fit (16
bytes per pair). The sample's settings come from :func:`sample_params`; the
assignment and the cluster sums (:mod:`server_kit.clustering.centroids`)
unpack a chunk of rows at a time, so time and memory past the sample are O(n).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .centroids import packed_cluster_sums
from .dendrogram import ch_from_sums, relabel

__all__ = ["MAX_EXACT_CLIENTS", "adopt_sample_fit", "draw_sample", "sample_params"]

#: Above this many clients, :class:`SketchClustering` clusters a seeded
#: sample of this size with the full method and assigns the rest to the
#: nearest centroid (O(n) memory; the exact method needs 16 bytes per pair,
#: 0.8 GB at 10,000 clients and 80 GB at 100,000).
MAX_EXACT_CLIENTS = 10_000

#: Fitted attributes of the sample's estimator that describe the whole fit.
_FROM_SAMPLE = ("linkage_", "distances_", "search_", "threshold_range_", "max_ch_", "null_ch_",
                "null_observed_ch_", "null_pvalue_", "refinements_", "separations_", "threshold_",
                "consolidated_")


def draw_sample(n: int, m: int, rs: np.random.RandomState) -> np.ndarray:
    """``m`` of ``n`` rows, sorted, drawn with a generator seeded from ``rs``."""
    rng = np.random.default_rng(rs.randint(0, 2**32 - 1, size=4, dtype=np.uint64))
    return np.sort(rng.choice(n, size=m, replace=False))


def sample_params(params: dict[str, Any], n: int, m: int, rs: np.random.RandomState) -> dict[str, Any]:
    """Settings of the estimator that clusters ``m`` of ``n`` clients; draws its seed from ``rs``."""
    mcs = int(params["min_cluster_size"])
    # a cluster of min_cluster_size clients holds about mcs * m / n of the sample
    return {**params, "max_exact_clients": None, "random_state": int(rs.randint(2**31 - 1)),
            "min_cluster_size": min(mcs, max(2, round(mcs * m / n)))}


def adopt_sample_fit(model: Any, inner: Any, packed: np.ndarray, n_bits: int, sample: np.ndarray) -> None:
    """Fill ``model`` from ``inner`` (fitted on ``packed[sample]``): every other client to the nearest centroid."""
    for name in _FROM_SAMPLE:
        setattr(model, name, getattr(inner, name))
    model.n_bits_ = n_bits
    model.centroids_ = inner.centroids_
    labels = model.predict(packed)
    labels[sample] = inner.labels_  # the sample keeps the full method's choice
    labels = relabel(labels)
    k = int(labels.max()) + 1
    sums, counts = packed_cluster_sums(packed, n_bits, labels, k)
    model.labels_ = labels
    model.n_clusters_ = k
    model.centroids_ = sums / counts[:, None]
    model.ch_score_ = None if k < 2 else ch_from_sums(sums, counts)
    model.sample_ = sample
