"""Cuts of a small dendrogram with its stragglers absorbed: the partition when no plain cut meets the size rule.

A cut of a Ward dendrogram is admissible when every cluster holds at least
``min_cluster_size`` clients. On a few clients whose sizes sit near that rule
(the OCFL splits: 15 clients, a group of 3, ``min_cluster_size`` 3), one
client far from the others merges last: every cut then has a cluster of 1 or 2
and none is admissible, although the groups are there. A refinement that
examines two such groups merged (8 clients, 3 + 5) then reads a statistic of
0, its permutation test gives p = 1, and the groups stay merged
(``benchmarks/RESULTS.md``, 2026-11-29).

:func:`absorbed_cut` gives such a set its partitions: for each number of
clusters ``j`` (up to ``2 * (n // min_cluster_size) + 2``), the ``j``-cut
first lets its clients move where Ward's own objective wants them
(:func:`~.refine.hartigan_moves`: a straggler merged early into the wrong
pair moves to its group), keeps its clusters of at least
``min_cluster_size`` clients (two or more of them), lets every other client
join the kept cluster whose within-cluster sum of squares it raises least
(``|c| / (|c| + 1) |x - c|^2`` in the fit's distances), and moves clients
again with the size rule kept. The best of these by the Calinski-Harabasz
index, computed from the same distances, is returned. It is used only where no plain cut is admissible, on
sets of at most :data:`ABSORBED_MAX_CLIENTS`, for the data and for every
permuted copy of the test alike (so the test is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.cluster.hierarchy import fcluster
from scipy.spatial.distance import squareform

from .dendrogram import relabel
from .refine import hartigan_moves, join_cost

__all__ = ["ABSORBED_MAX_CLIENTS", "AbsorbedCut", "absorbed_cut", "ch_from_distances"]

#: Clients at most for :func:`absorbed_cut`.
ABSORBED_MAX_CLIENTS = 200

#: Passes of Hartigan's moves per candidate partition.
_PASSES = 10


@dataclass(frozen=True)
class AbsorbedCut:
    """The best absorbed partition: its CH, labels, and a threshold of the cut it came from (between its merges)."""

    ch: float
    labels: np.ndarray
    threshold: float


def ch_from_distances(d: np.ndarray, labels: np.ndarray) -> float:
    """Calinski-Harabasz index of ``labels`` from squared distances ``d`` (square): pair sums over sizes."""
    n = labels.size
    k = int(labels.max()) + 1
    if k < 2 or k >= n:
        return 0.0
    member = np.zeros((n, k))
    member[np.arange(n), labels] = 1.0
    within = float((np.einsum("ic,ic->c", d @ member, member) / (2 * member.sum(axis=0))).sum())
    total = float(d.sum() / (2 * n))
    if within <= 0:
        return float("inf")
    return (total - within) / (k - 1) / (within / (n - k))


def _absorb(d: np.ndarray, labels: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Every client of a cluster not in ``keep`` joins the kept cluster it costs least (Ward's increase)."""
    kept = np.flatnonzero(keep)
    member = (labels[:, None] == kept[None, :]).astype(np.float64)
    near = d @ member
    cost = join_cost(near, np.einsum("ic,ic->c", near, member), member.sum(axis=0))
    out = labels.copy()
    loose = ~np.isin(labels, kept)
    out[loose] = kept[np.argmin(cost[loose], axis=1)]
    return relabel(out)


def absorbed_cut(linkage: np.ndarray, distances: np.ndarray, min_cluster_size: int) -> AbsorbedCut | None:
    """The best partition of the dendrogram's cuts with stragglers absorbed; None if there is none.

    ``distances``: the condensed distances the dendrogram was built on (its
    squared Euclidean geometry).
    """
    n = linkage.shape[0] + 1
    mcs = max(1, int(min_cluster_size))
    if n < 2 * mcs or n > ABSORBED_MAX_CLIENTS:
        return None
    d = squareform(np.asarray(distances)).astype(np.float64)
    best: AbsorbedCut | None = None
    seen: set[bytes] = set()
    for j in range(2, min(n - 1, 2 * (n // mcs) + 2) + 1):
        # the j-cut, its clients moved where Ward's objective wants them, the clusters still under the
        # size rule absorbed, and the moves again with the rule kept
        labels, _ = hartigan_moves(d, fcluster(linkage, j, criterion="maxclust") - 1, _PASSES, 1)
        keep = np.bincount(labels) >= mcs
        if keep.sum() < 2:
            continue
        part, _ = hartigan_moves(d, _absorb(d, labels, keep), _PASSES, mcs)
        key = part.tobytes()
        if key in seen:
            continue
        seen.add(key)
        ch = ch_from_distances(d, part)
        if ch > 0 and (best is None or ch > best.ch):
            heights = linkage[:, 2]
            best = AbsorbedCut(ch, part, float((heights[n - j - 1] + heights[n - j]) / 2))
    return best
