"""The Ward dendrogram of bit sketches, its cuts and their Calinski-Harabasz scores (pure functions).

For 0/1 vectors the squared Euclidean distance *is* the Hamming distance, so
Ward linkage on ``sqrt(hamming)`` is exactly Ward linkage on the bit vectors.
The CH index of any cut is read off the dendrogram in O(1): a Ward merge at
height ``h`` raises the within-cluster sum of squares by exactly ``h**2 / 2``,
so the within (W) and between (B) sums of squares of the cut after ``m``
merges are prefix and suffix sums of the squared merge heights
(:func:`cut_profile`). :func:`calinski_harabasz_bits` scores any partition of
the bits themselves, from its cluster sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.cluster.hierarchy import linkage

__all__ = [
    "CutProfile",
    "W_FLOOR",
    "calinski_harabasz_bits",
    "ch_from_sums",
    "cluster_sums",
    "cut_profile",
    "relabel",
    "sqrt_float64",
    "square_int32",
    "ward_linkage",
]

#: Smallest non-zero within-cluster sum of squares 0/1 data can have (two
#: members differing in one bit). A partition of identical sketches has W = 0
#: and an infinite CH; W is floored here so that its CH stays finite and at
#: least as high as that of any partition with real spread.
W_FLOOR = 0.5


def ward_linkage(distances: np.ndarray) -> np.ndarray:
    """Ward linkage matrix of condensed Hamming distances between 0/1 vectors.

    ``scipy.cluster.hierarchy.linkage(sqrt(distances), "ward")``: for bit
    vectors the Euclidean distance is the square root of the Hamming distance,
    so this equals ``linkage(bits.astype(float), "ward")`` without the
    O(n**2 * n_bits) float distance computation. The square roots are written
    straight into one float64 buffer (no temporary of the input's size).
    """
    d = np.asarray(distances)
    if d.ndim != 1:
        raise ValueError(f"distances must be a condensed 1-D array, got shape {d.shape}")
    return linkage(sqrt_float64(d), method="ward")


#: Elements per chunk when converting condensed distances (8 MiB of float64).
_CHUNK = 1 << 20


def sqrt_float64(d: np.ndarray) -> np.ndarray:
    """``sqrt(d)`` as a new float64 array, converted chunk by chunk."""
    s = np.empty(d.shape, dtype=np.float64)
    for i in range(0, d.size, _CHUNK):
        part = s[i : i + _CHUNK]
        part[:] = d[i : i + _CHUNK]
        np.sqrt(part, out=part)
    return s


def square_int32(s: np.ndarray) -> np.ndarray:
    """Integer distances back from their square roots (exact: ``rint(s * s)``)."""
    d = np.empty(s.shape, dtype=np.int32)
    for i in range(0, s.size, _CHUNK):
        part = s[i : i + _CHUNK]
        np.rint(part * part, out=d[i : i + _CHUNK], casting="unsafe")
    return d


@dataclass(frozen=True)
class CutProfile:
    """Every cut of a Ward dendrogram of ``n`` points, indexed by merges done.

    Index ``m`` (0 to ``n - 1``) is the partition after the ``m`` lowest
    merges, the one ``fcluster(Z, t, "distance")`` returns for
    ``heights[m - 1] <= t < heights[m]``.

    Attributes
    ----------
    heights : ndarray, shape (n - 1,)
        Merge heights, non-decreasing.
    n_clusters : ndarray of int, shape (n,)
        ``n - m``.
    ch : ndarray, shape (n,)
        Calinski-Harabasz index of each cut; NaN for the single cluster.
    allowed : ndarray of bool, shape (n,)
        At least 2 clusters and every cluster at least ``min_cluster_size``.
    reachable : ndarray of bool, shape (n,)
        Some positive threshold gives this cut (ties in height skip cuts).
    """

    heights: np.ndarray
    n_clusters: np.ndarray
    ch: np.ndarray
    allowed: np.ndarray
    reachable: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        """Cuts a threshold can reach that satisfy the size rules."""
        return self.allowed & self.reachable

    def merges_at(self, threshold: float) -> int:
        """Number of merges at or below ``threshold`` (the cut's index)."""
        return int(np.searchsorted(self.heights, threshold, side="right"))

    def best(self) -> tuple[int, float]:
        """Index and CH of the valid cut with the highest CH; ``(-1, 0.0)`` if none."""
        valid = self.valid
        if not valid.any():
            return -1, 0.0
        scores = np.where(valid, self.ch, -np.inf)
        m = int(np.argmax(scores))
        return m, float(scores[m])


def cut_profile(z: np.ndarray, min_cluster_size: int = 1) -> CutProfile:
    """CH index, cluster count and size rule of every cut of a Ward dendrogram.

    O(n) in all: ``W`` after ``m`` merges is ``sum(h[:m] ** 2) / 2`` and
    ``B = T - W`` is ``sum(h[m:] ** 2) / 2`` (Ward's merge cost). The
    smallest cluster size only grows as merges proceed, so the size rule holds
    from some merge on; it is tracked by counting the clusters still below
    ``min_cluster_size``.
    """
    z = np.asarray(z, dtype=np.float64)
    n = z.shape[0] + 1
    h = z[:, 2]
    cost = h * h / 2.0
    within = np.concatenate(([0.0], np.cumsum(cost)))  # W after m merges
    between = np.concatenate((np.cumsum(cost[::-1])[::-1], [0.0]))  # B after m merges
    k = n - np.arange(n)
    ch = np.full(n, np.nan)
    multi = k >= 2
    ch[multi] = (between[multi] * (n - k[multi])) / (
        np.maximum(within[multi], W_FLOOR) * (k[multi] - 1)
    )

    sizes = np.concatenate((np.ones(n), z[:, 3]))
    a = sizes[z[:, 0].astype(np.intp)]
    b = sizes[z[:, 1].astype(np.intp)]
    mcs = int(min_cluster_size)
    delta = (a + b < mcs).astype(np.int64) - (a < mcs) - (b < mcs)
    small = (n if mcs > 1 else 0) + np.concatenate(([0], np.cumsum(delta)))
    allowed = multi & (small == 0)

    reachable = np.ones(n, dtype=bool)
    if n > 1:
        reachable[0] = h[0] > 0
        reachable[1:-1] = h[:-1] < h[1:]
    return CutProfile(h, k, ch, allowed, reachable)


def cluster_sums(bits: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster bit sums (k, n_bits) int64 and sizes (k,) for labels 0..k-1."""
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=k)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    sums = np.add.reduceat(bits[order], starts, axis=0, dtype=np.int64)
    return sums, counts


def calinski_harabasz_bits(bits: np.ndarray, labels: np.ndarray) -> float:
    """Calinski-Harabasz index of a partition of 0/1 vectors, exact from cluster sums.

    Same value as ``sklearn.metrics.calinski_harabasz_score(bits, labels)``
    in O(n * n_bits) integer work: with per-cluster bit sums ``S_k`` and
    sizes ``n_k``, ``W = sum(bits) - sum_k |S_k|**2 / n_k`` (a 0/1 vector's
    squared norm is its popcount) and ``B = sum_k |S_k|**2 / n_k - |S|**2 / n``.
    Where every cluster holds identical vectors (W = 0) the index is infinite;
    W is then taken as :data:`W_FLOOR` (scikit-learn returns 1.0 instead).
    """
    x = np.asarray(bits)
    lab = np.asarray(labels)
    _, lab = np.unique(lab, return_inverse=True)
    lab = lab.reshape(-1)
    n = x.shape[0]
    k = int(lab.max()) + 1 if n else 0
    if not 2 <= k < n:
        raise ValueError(f"the index needs 2 <= clusters < samples, got {k} clusters of {n}")
    return ch_from_sums(*cluster_sums(x, lab, k))


def ch_from_sums(sums: np.ndarray, counts: np.ndarray) -> float:
    """CH index from per-cluster bit sums (k, n_bits) and sizes (k,) (see :func:`calinski_harabasz_bits`)."""
    n, k = int(counts.sum()), counts.size
    sq = np.einsum("ij,ij->i", sums, sums).astype(np.float64)
    fit = float((sq / counts).sum())
    total = sums.sum(axis=0)
    within = float(total.sum()) - fit  # a 0/1 row's squared norm is its popcount
    between = fit - float(total @ total) / n
    return between * (n - k) / (max(within, W_FLOOR) * (k - 1))


def relabel(labels: np.ndarray) -> np.ndarray:
    """Labels renumbered 0..k-1 in order of first appearance."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.intp)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse.reshape(-1)]
