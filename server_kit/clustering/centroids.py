"""Nearest-centroid assignment of packed sketches, in chunks: the late-joiner rule.

A client joins the cluster whose mean bit vector is nearest to its sketch.
:class:`NearestCentroids` gives :class:`~server_kit.clustering.sketch.SketchClustering`
its ``predict`` and ``from_centroids``; the fleet-scale path
(:mod:`server_kit.clustering.sampled`) assigns every client outside its
sample the same way. Rows are unpacked :data:`PREDICT_CHUNK` at a time, so
memory stays O(chunk) for a million clients. With ``device`` (default
``"auto"``), a large fleet is assigned on a CUDA GPU by torch, with the same
labels (:mod:`server_kit.clustering.on_device`).
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from edge_sdk import bits as _bits

from .params import check_packed

__all__ = ["NearestCentroids", "PREDICT_CHUNK", "nearest_centroids", "packed_cluster_sums"]

#: Rows unpacked at a time when predicting or summing a large fleet.
PREDICT_CHUNK = 1 << 15

_Model = TypeVar("_Model", bound="NearestCentroids")


def nearest_centroids(packed: np.ndarray, n_bits: int, centroids: np.ndarray, *,
                      device: str = "auto") -> np.ndarray:
    """Label of each packed row: its nearest centroid, ties to the lower label.

    Distance is the squared Euclidean distance between the row's 0/1 vector
    and each centroid (a cluster's mean bit vector). ``device``: one of
    :data:`~server_kit.clustering.on_device.DEVICES`; ``"auto"`` takes the GPU
    for :data:`~server_kit.clustering.on_device.AUTO_MIN_ROWS` rows or more
    when torch sees one, ``"cpu"`` is this numpy code, ``"cuda"`` insists on the GPU.
    """
    from . import on_device  # here: importing the package never loads torch

    target = on_device.choose_device(device, packed.shape[0])
    if target is not None:
        return on_device.nearest_centroids_torch(packed, n_bits, centroids, target)
    c = centroids
    cc = np.einsum("ij,ij->i", c, c)[None, :]
    tol = 1e-9 * max(1, n_bits)
    out = np.empty(packed.shape[0], dtype=np.intp)
    for i in range(0, packed.shape[0], PREDICT_CHUNK):  # O(chunk) memory for a million clients
        x = _bits.unpack_bits(packed[i : i + PREDICT_CHUNK], n_bits).astype(np.float64)
        d = x.sum(axis=1)[:, None] - 2.0 * (x @ c.T) + cc
        out[i : i + x.shape[0]] = np.argmax(d <= d.min(axis=1, keepdims=True) + tol, axis=1)
    return out


def packed_cluster_sums(packed: np.ndarray, n_bits: int, labels: np.ndarray,
                        k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~server_kit.clustering.dendrogram.cluster_sums` of packed rows, unpacked a chunk at a time."""
    sums = np.zeros((k, n_bits), dtype=np.int64)
    for i in range(0, packed.shape[0], PREDICT_CHUNK):
        bits = _bits.unpack_bits(packed[i : i + PREDICT_CHUNK], n_bits)
        lab = labels[i : i + PREDICT_CHUNK]
        for c in np.unique(lab):
            sums[c] += bits[lab == c].sum(axis=0, dtype=np.int64)
    return sums, np.bincount(labels, minlength=k)


class NearestCentroids:
    """``predict`` from fitted ``centroids_`` and ``n_bits_``, and an estimator restored from centroids."""

    centroids_: np.ndarray
    n_bits_: int
    n_clusters_: int

    @classmethod
    def from_centroids(cls: type[_Model], centroids: np.ndarray, n_bits: int, **params: Any) -> _Model:
        """An estimator that only predicts, restored from saved centroids (server checkpoints)."""
        c = np.asarray(centroids, dtype=np.float64)
        if c.ndim != 2 or c.shape[1] != int(n_bits) or c.shape[0] < 1:
            raise ValueError(f"centroids must have shape (k >= 1, {n_bits}), got {c.shape}")
        if not np.isfinite(c).all() or c.min() < 0 or c.max() > 1:
            raise ValueError("centroids must be mean bits in [0, 1]")
        model = cls(**params)
        model.centroids_ = c
        model.n_bits_ = int(n_bits)
        model.n_clusters_ = c.shape[0]
        return model

    def predict(self, packed: np.ndarray) -> np.ndarray:
        """Cluster of each new client: the nearest centroid, ties to the lower label.

        Distance is the squared Euclidean distance between the client's 0/1
        vector and each cluster's mean bit vector.
        """
        if not hasattr(self, "centroids_"):
            raise ValueError("this SketchClustering is not fitted yet: call fit first")
        p = check_packed(packed, self.n_bits_)
        return nearest_centroids(p, self.n_bits_, self.centroids_)
