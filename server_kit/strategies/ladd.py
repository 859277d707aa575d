"""LADD, as compared in the FedSketch paper: K-means on per-class Fourier amplitudes, once.

Before training, every client sends :func:`edge_sdk.features.ladd_features`
of its data (per class, the mean of the centred ``(2b+1) x (2b+1)`` window
of the images' shifted 2-D FFT amplitudes); the server concatenates each
client's rows, clusters the vectors with K-means for the given K, and then
runs FedAvg per cluster (:class:`~server_kit.strategies.clustered.ClusteredFedAvg`). A
late client joins the cluster of the nearest K-means centre.

FFT amplitudes cannot tell an image from its 180-degree rotation, so clients
rotated by 0 and 180 degrees (or 90 and 270) look alike to LADD.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from .base import ClientInfo
from .capabilities import Capabilities
from .clustered import ClusteredFedAvg

__all__ = ["LADD", "nearest_center"]

log = logging.getLogger(__name__)

_CENTERS = "_ladd/centers"


def nearest_center(centers: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of the nearest row of ``centers`` (Euclidean) for each row of ``x``.

    What ``KMeans.predict`` computes, without needing the fitted estimator
    (so a checkpoint restores it from the centres alone). Ties go to the
    lower index.
    """
    c = np.asarray(centers, dtype=np.float64)
    v = np.asarray(x, dtype=np.float64)
    d = ((v[:, None, :] - c[None, :, :]) ** 2).sum(axis=-1)
    return np.argmin(d, axis=1)


class LADD(ClusteredFedAvg):
    """Cluster once from LADD's Fourier summaries with K-means, then FedAvg per cluster.

    Parameters
    ----------
    k : int
        Number of clusters given to K-means (4 in the paper's comparison).
    b : int, optional
        Half-width of the clients' FFT window, passed to
        :func:`edge_sdk.features.ladd_features` through ``summary_params``;
        None lets the client use ``floor(0.1 * min(H, W))`` (at least 1).
    shared_prefixes, settings, fraction, seed
        As for :class:`~server_kit.strategies.clustered.ClusteredFedAvg`; ``seed`` is also
        K-means' ``random_state``.

    Attributes
    ----------
    kmeans_ : sklearn.cluster.KMeans or None
        The fitted estimator (None before clustering and after a restore).
    centers_ : numpy.ndarray or None
        ``(k, C * W)`` K-means centres, used for late clients.
    """

    name = "ladd"
    capabilities = Capabilities(needs_sketches=True, summary_kind="ladd")

    def __init__(self, *, k: int = 4, b: int | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0):
            raise ValueError(f"b must be a non-negative integer or None, got {b!r}")
        self.k = int(k)
        self.capabilities = replace(type(self).capabilities, summary_params={"b": None if b is None else int(b)})
        self.kmeans_: Any = None
        self.centers_: np.ndarray | None = None
        self._shape: tuple[int, ...] | None = None

    @staticmethod
    def _vector(cid: str, features: Any, shape: tuple[int, ...] | None) -> np.ndarray:
        a = np.asarray(features)
        if a.ndim != 2 or not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"features of {cid!r} must be a 2-D float array (classes, window), got "
                             f"{a.dtype} {a.shape}")
        if shape is not None and a.shape != shape:
            raise ValueError(f"features of {cid!r} have shape {a.shape}, expected {shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"features of {cid!r} contain NaN or Inf")
        return a.reshape(-1).astype(np.float64)

    def on_sketches(self, sketches: Mapping[str, Any]) -> dict[str, int]:
        """K-means over the clients' flattened ``(num_classes, W)`` feature arrays."""
        from sklearn.cluster import KMeans

        if not sketches:
            raise ValueError("no LADD features to cluster")
        cids = sorted(sketches)
        if len(cids) < self.k:
            raise ValueError(f"K-means with k={self.k} needs at least {self.k} clients, got {len(cids)}")
        shape = tuple(np.shape(sketches[cids[0]]))
        x = np.stack([self._vector(c, sketches[c], shape) for c in cids])
        self.kmeans_ = KMeans(n_clusters=self.k, n_init=10, random_state=self.seed).fit(x)
        self.centers_ = np.asarray(self.kmeans_.cluster_centers_, dtype=np.float64)
        self._shape = shape
        assignment = {c: int(j) for c, j in zip(cids, self.kmeans_.labels_)}
        log.info("LADD: %d clients, %d features each, into %d clusters (inertia %.4g)",
                 len(cids), x.shape[1], self.k, self.kmeans_.inertia_)
        self.set_assignment(assignment)
        return assignment

    def assign_late(self, cid: str, sketch: Any = None, info: ClientInfo | None = None) -> str:
        """A new client joins the cluster of the nearest K-means centre (``sketch``: its features)."""
        if info is not None:
            self.clients[cid] = info
        if cid in self.assignment:
            return self.key(self.assignment[cid])
        if self.centers_ is None or sketch is None:
            raise ValueError(f"late client {cid!r} needs LADD features and a fitted clustering")
        v = self._vector(cid, sketch, self._shape)
        if v.shape[0] != self.centers_.shape[1]:
            raise ValueError(f"features of {cid!r} have {v.shape[0]} values, the centres "
                             f"{self.centers_.shape[1]}")
        j = int(nearest_center(self.centers_, v[None])[0])
        self.assignment[cid] = j
        if self.key(j) not in self.models:  # K-means left that cluster empty (duplicate points)
            self.models[self.key(j)] = {n: v.copy() for n, v in next(iter(self.models.values())).items()}
        log.info("late client %s joins LADD cluster %d (nearest centre)", cid, j)
        return self.key(j)

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["k"] = self.k
        if self.centers_ is not None:
            tensors[_CENTERS] = self.centers_
            meta["feature_shape"] = list(self._shape or ())
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        tensors = dict(tensors)
        centers = tensors.pop(_CENTERS, None)
        super().load_state(meta, tensors)
        self.kmeans_ = None
        self.centers_ = None if centers is None else np.asarray(centers, dtype=np.float64)
        shape = meta.get("feature_shape")
        self._shape = tuple(int(d) for d in shape) if shape else None
