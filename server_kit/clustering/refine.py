"""After the cut: the settings of a refinement's nested clustering, and consolidation by k-means passes.

Refinement clusters each large enough cluster again with the same procedure
(:meth:`server_kit.clustering.sketch.SketchClustering.fit`, on the settings of
:func:`child_params`); consolidation (:func:`consolidate`) then moves every
client to its nearest cluster mean.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .dendrogram import cluster_sums, relabel

__all__ = ["HARTIGAN_MAX_CLIENTS", "QuietLogger", "REFINE_NULL_MAX_CLIENTS", "child_params", "consolidate",
           "consolidate_small", "hartigan_moves", "join_cost"]

#: Clients a refinement's permutation test looks at, at most (a random subset
#: of a larger cluster): enough power for real structure, and ten clusters of
#: a FEMNIST-size federation cost a few tenths of a second.
REFINE_NULL_MAX_CLIENTS = 200


#: Clients at most for :func:`consolidate_small` (Hartigan's moves), which holds the square matrix of the fit's distances
#: (float64, both halves: 32 MB at this size).
HARTIGAN_MAX_CLIENTS = 2000


class QuietLogger:
    """Lower a logger to WARNING for the duration (children of a refinement log at DEBUG only)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def __enter__(self) -> None:
        self.level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.DEBUG:
            self.logger.setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)


def child_params(params: dict[str, Any], n_examined: int, rs: np.random.RandomState) -> dict[str, Any]:
    """Settings of the estimator that examines one cluster, from its parent's ``params``.

    One test per examined cluster: Bonferroni over them, and enough
    permutations for the smaller level to be reachable. Draws the child's
    seed from ``rs``.
    """
    alpha = float(params["single_cluster_alpha"]) / n_examined
    return {**params, "random_state": int(rs.randint(2**31 - 1)),
            "null_max_clients": min(int(params["null_max_clients"]), REFINE_NULL_MAX_CLIENTS),
            "single_cluster_alpha": alpha,
            "n_null": max(int(params["n_null"]), int(np.ceil(1.0 / alpha - 1e-9)) - 1)}


def consolidate(bits: np.ndarray, labels: np.ndarray, passes: int) -> tuple[np.ndarray, int]:
    """Move every client to its nearest cluster mean, repeatedly (k-means passes from the cut).

    Ward's cut is greedy: a client merged early into a group stays there even
    when another group's mean ends up nearer (at 1,000 digits devices, 2 to 5
    clients per run). Consolidating the hierarchical partition with k-means
    passes (as in HCPC, Husson et al. 2010) moves them. Stops when no client
    moves, after ``passes`` passes, or if a cluster would empty. Run only
    when every cluster holds at least ``MIN_SIDE`` (20) clients: among a few
    noisy clients, a mean that holds the client itself is a poor guide.
    Returns the labels and the number of clients moved in all.
    """
    x = bits.astype(np.float64)
    norms = x.sum(axis=1)[:, None]
    moved = 0
    for _ in range(passes):
        k = int(labels.max()) + 1
        sums, counts = cluster_sums(bits, labels, k)
        c = sums / counts[:, None]
        new = np.argmin(norms - 2.0 * (x @ c.T) + np.einsum("ij,ij->i", c, c)[None, :], axis=1)
        changed = int((new != labels).sum())
        if changed == 0 or np.bincount(new, minlength=k).min() == 0:
            break
        labels, moved = new, moved + changed
    return relabel(labels), moved


def consolidate_small(distances: np.ndarray, labels: np.ndarray, passes: int,
                      min_size: int) -> tuple[np.ndarray, int]:
    """Hartigan's moves on Ward's own objective, in the fit's own distances (:func:`hartigan_moves`).

    The consolidation of partitions with a cluster under ``MIN_SIDE`` (20)
    clients, where :func:`consolidate`'s bit means are a poor guide.
    ``distances`` are the condensed distances the dendrogram was built on
    (block-clipped Hamming by default). Returns the labels and the moves made.
    """
    from scipy.spatial.distance import squareform

    return hartigan_moves(squareform(np.asarray(distances)).astype(np.float64), labels, passes, min_size)


def join_cost(near: np.ndarray, pairs: np.ndarray, size: np.ndarray) -> np.ndarray:
    """What adding a client to each cluster adds to Ward's within-cluster sum of squares.

    ``near[..., c]``: the sum of the client's distances to ``c``'s members;
    ``pairs[c]``: the sum of ``c``'s distances over its ordered pairs; ``size[c]``
    its members (Ward's squared Euclidean distances). ``|c| / (|c| + 1) |x - c|^2``,
    where ``|x - c|^2`` is the mean distance to the members less half their mean
    pairwise distance; infinite for an empty cluster.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        sq = near / size - 0.5 * pairs / size**2
        return np.where(size > 0, sq * size / (size + 1), np.inf)


def hartigan_moves(d: np.ndarray, labels: np.ndarray, passes: int, min_size: int) -> tuple[np.ndarray, int]:
    """Move one client at a time to the cluster where it lowers Ward's within-cluster sum of squares most.

    ``d``: the square matrix of Ward's squared Euclidean distances, in which a
    cluster's centroid is implicit (``|x - c_A|^2`` is the mean distance of
    ``x`` to ``A``'s members less half their mean pairwise distance). Ward's
    merges greedily lower the within-cluster sum of squares, and a client
    merged early stays where its first partner was. A client moves from ``A``
    to ``B`` when that lowers the same sum (Hartigan and Wong's rule:
    ``|B| / (|B| + 1) |x - c_B|^2 < |A| / (|A| - 1) |x - c_A|^2``), so each
    move is exact, not a guess from a mean that holds the client itself. A
    cluster never drops below ``min_size``. Passes over every client until
    none moves, at most ``passes``. Returns the labels (0..k-1) and the moves made.
    """
    lab = np.asarray(labels).copy()
    n, k = lab.size, int(lab.max()) + 1
    member = np.zeros((n, k))
    member[np.arange(n), lab] = 1.0
    near = d @ member  # near[i, c]: the sum of i's distances to c's members
    size = member.sum(axis=0)
    pairs = np.einsum("ic,ic->c", near, member)  # per cluster, the sum over its ordered pairs
    moved = 0
    for _ in range(passes):
        before = moved
        for i in range(n):
            a = int(lab[i])
            if size[a] - 1 < max(1, int(min_size)):
                continue
            cost = join_cost(near[i], pairs, size)
            # leaving a, which holds it: what its removal takes off, |a| / (|a| - 1) |x_i - c_a|^2
            cost[a] = (near[i, a] / size[a] - 0.5 * pairs[a] / size[a] ** 2) * size[a] / (size[a] - 1)
            b = int(np.argmin(cost))
            if b == a or not cost[b] < cost[a]:
                continue
            pairs[a] -= 2 * near[i, a]
            near[:, a] -= d[:, i]
            pairs[b] += 2 * near[i, b]
            near[:, b] += d[:, i]
            size[a] -= 1
            size[b] += 1
            lab[i] = b
            moved += 1
        if moved == before:
            break
    return relabel(lab), moved
