"""Clustering clients from their bit sketches (Prigent et al., Algorithms 2 and 3).

The server receives one packed bit sketch per client and groups the clients
without being told how many groups there are:

1. pairwise Hamming distances straight from the packed bytes
   (:func:`edge_sdk.bits.hamming_pdist`, a compiled popcount);
2. one Ward dendrogram: for 0/1 vectors the squared Euclidean distance *is*
   the Hamming distance, so Ward linkage on ``sqrt(hamming)`` is exactly Ward
   linkage on the bit vectors, built once;
3. a distance threshold chosen by Bayesian optimisation of the
   Calinski-Harabasz (CH) index, every probe being a cut of that same
   dendrogram (the paper maximises CH; its public code minimises it);
4. a permutation test that decides between one cluster and several, because
   CH is undefined for a single cluster.

The CH index of any cut is read off the dendrogram in O(1): a Ward merge at
height ``h`` raises the within-cluster sum of squares by exactly ``h**2 / 2``,
so the within (W) and between (B) sums of squares of the cut after ``m``
merges are prefix and suffix sums of the squared merge heights. Tests check
this against :func:`sklearn.metrics.calinski_harabasz_score` on the bits.
"""

from __future__ import annotations

import logging
import numbers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from sklearn.utils import check_random_state
from threadpoolctl import threadpool_limits

from edge_sdk import bits as _bits
from edge_sdk._validation import check_int

from .separation import MIN_SEPARATION, MIN_SIDE, merge_inseparable

__all__ = [
    "CutProfile",
    "SketchClustering",
    "calinski_harabasz_bits",
    "cut_profile",
    "plot_search",
    "ward_linkage",
]

log = logging.getLogger(__name__)

#: Smallest non-zero within-cluster sum of squares 0/1 data can have (two
#: members differing in one bit). A partition of identical sketches has W = 0
#: and an infinite CH; W is floored here so that its CH stays finite and at
#: least as high as that of any partition with real spread.
W_FLOOR = 0.5

#: Clients a refinement's permutation test looks at, at most (a random subset
#: of a larger cluster): enough power for real structure, and ten clusters of
#: a FEMNIST-size federation cost a few tenths of a second.
REFINE_NULL_MAX_CLIENTS = 200

#: Above this many clients, :class:`SketchClustering` clusters a seeded
#: sample of this size with the full method and assigns the rest to the
#: nearest centroid (O(n) memory; the exact method needs 16 bytes per pair,
#: 0.8 GB at 10,000 clients and 80 GB at 100,000).
MAX_EXACT_CLIENTS = 10_000

#: Rows unpacked at a time when predicting or summing a large fleet.
_PREDICT_CHUNK = 1 << 15

#: Acquisition functions of ``skopt.gp_minimize`` that the estimator accepts.
#: "LCB" on -CH is the paper's upper confidence bound on CH.
ACQ_FUNCS = ("EI", "LCB", "PI", "gp_hedge")


# --------------------------------------------------------------------------
# Pure functions: the dendrogram, its cuts and their CH scores
# --------------------------------------------------------------------------


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
    return linkage(_sqrt_float64(d), method="ward")


#: Elements per chunk when converting condensed distances (8 MiB of float64).
_CHUNK = 1 << 20


def _sqrt_float64(d: np.ndarray) -> np.ndarray:
    """``sqrt(d)`` as a new float64 array, converted chunk by chunk."""
    s = np.empty(d.shape, dtype=np.float64)
    for i in range(0, d.size, _CHUNK):
        part = s[i : i + _CHUNK]
        part[:] = d[i : i + _CHUNK]
        np.sqrt(part, out=part)
    return s


def _square_int32(s: np.ndarray) -> np.ndarray:
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


def _cluster_sums(bits: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
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
    return _ch_from_sums(*_cluster_sums(x, lab, k))


def _ch_from_sums(sums: np.ndarray, counts: np.ndarray) -> float:
    """CH index from per-cluster bit sums (k, n_bits) and sizes (k,) (see :func:`calinski_harabasz_bits`)."""
    n, k = int(counts.sum()), counts.size
    sq = np.einsum("ij,ij->i", sums, sums).astype(np.float64)
    fit = float((sq / counts).sum())
    total = sums.sum(axis=0)
    within = float(total.sum()) - fit  # a 0/1 row's squared norm is its popcount
    between = fit - float(total @ total) / n
    return between * (n - k) / (max(within, W_FLOOR) * (k - 1))


def _packed_cluster_sums(packed: np.ndarray, n_bits: int, labels: np.ndarray,
                         k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_cluster_sums` of packed rows, unpacked a chunk at a time (O(chunk) memory)."""
    sums = np.zeros((k, n_bits), dtype=np.int64)
    for i in range(0, packed.shape[0], _PREDICT_CHUNK):
        bits = _bits.unpack_bits(packed[i : i + _PREDICT_CHUNK], n_bits)
        lab = labels[i : i + _PREDICT_CHUNK]
        for c in np.unique(lab):
            sums[c] += bits[lab == c].sum(axis=0, dtype=np.int64)
    return sums, np.bincount(labels, minlength=k)


class _quiet:
    """Lower a logger to WARNING for the duration (children of a refinement log at DEBUG only)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def __enter__(self) -> None:
        self.level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.DEBUG:
            self.logger.setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        self.logger.setLevel(self.level)


def _relabel(labels: np.ndarray) -> np.ndarray:
    """Labels renumbered 0..k-1 in order of first appearance."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.intp)
    rank[np.argsort(first)] = np.arange(first.size)
    return rank[inverse.reshape(-1)]


def _consolidate(bits: np.ndarray, labels: np.ndarray, passes: int) -> tuple[np.ndarray, int]:
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
        sums, counts = _cluster_sums(bits, labels, k)
        c = sums / counts[:, None]
        new = np.argmin(norms - 2.0 * (x @ c.T) + np.einsum("ij,ij->i", c, c)[None, :], axis=1)
        changed = int((new != labels).sum())
        if changed == 0 or np.bincount(new, minlength=k).min() == 0:
            break
        labels, moved = new, moved + changed
    return _relabel(labels), moved


def _max_valid_ch(bits: np.ndarray, n_bits: int, min_cluster_size: int) -> float:
    """Highest CH over the valid cuts of the Ward dendrogram of 0/1 rows (0 if none)."""
    d = _bits.hamming_pdist(np.packbits(bits, axis=1), n_bits)
    return cut_profile(ward_linkage(d), min_cluster_size).best()[1]


# --------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------


class SketchClustering:
    """Cluster clients from packed bit sketches; the number of clusters is found.

    Ward agglomerative clustering on the sketches' Hamming geometry, with the
    distance threshold chosen by Bayesian optimisation of the
    Calinski-Harabasz index (Prigent et al., Algorithm 2), then a permutation
    test for "one cluster" (see Notes).

    Parameters
    ----------
    min_cluster_size : int, default 2
        A threshold is admissible only if every cluster it yields holds at
        least this many clients (the paper uses 10 for MNIST, 100 for FEMNIST).
    n_calls : int, default 35
        Thresholds probed in total.
    n_initial_points : int, default 30
        Random probes before the Gaussian process guides the search.
    acq_func : {"LCB", "EI", "PI", "gp_hedge"}, default "LCB"
        Acquisition function of ``skopt.gp_minimize`` (default Matern 2.5
        Gaussian process). "LCB" on -CH is the paper's UCB on CH.
    kappa : float, default 1.96
        Exploration weight of LCB.
    threshold_range : (float, float), optional
        ``(low, high)`` with ``0 < low < high``, searched log-uniformly. By
        default the range comes from the dendrogram itself (see Notes), so it
        scales with the sketch length and the number of clients.
    single_cluster_alpha : float, default 0.05
        Level of the permutation test: several clusters are kept only if its
        p-value is at most this.
    n_null : int, default 19
        Permuted data sets of the test; ``(n_null + 1) * single_cluster_alpha``
        must be at least 1 so the test can reject. 0 skips the test.
    null_max_clients : int, default 500
        The test runs on a random subset of this many clients when there are
        more (each permuted copy needs its own dendrogram).
    refine : bool, default True
        Nested groups: after the top-level partition, cluster every cluster of
        at least ``2 * min_cluster_size`` clients again with the same
        procedure (its own dendrogram, CH search and permutation test) and
        split it when its test finds structure (see Notes). False gives the
        flat, single-level choice.
    max_depth : int, default 4
        Levels of refinement at most. A refinement's permutation test looks
        at no more than ``REFINE_NULL_MAX_CLIENTS`` (200) clients of the
        cluster it examines.
    min_separation : float or None, default 5.0
        Clusters of a cut (the top level's and every refinement's) whose
        separation (:func:`server_kit.clustering.separation.separation`,
        Ashman's D on a held-out projection) is below this are merged back,
        nearest first (see Notes). None or 0 keeps every cut as chosen; with
        ``refine=False`` and ``n_null=0`` that is the paper's method.
    consolidate : int, default 10
        After the final partition, k-means passes from it: every client moves
        to its nearest cluster mean until none moves (at most this many
        passes; 0 keeps Ward's assignment). Ward's greedy merges leave a few
        boundary clients in the farther cluster; this moves them. Like the
        separation check, it applies only where every cluster (for the check:
        both of a pair) holds at least 20 clients; smaller ones are left to
        the permutation test and Ward.
    max_exact_clients : int or None, default 10,000
        Above this many clients, a seeded sample of this size is clustered
        with the full method and every client is then assigned to the nearest
        centroid (the late-joiner rule), in chunks: time and memory O(n) past
        the sample. None always runs the exact method (16 bytes per pair of
        clients).
    random_state : int, RandomState or None
        Seeds the optimiser's random probes, the subset and the permutations.

    Attributes
    ----------
    labels_ : ndarray of int, shape (n_clients,)
        Cluster of each client, 0..k-1 in order of first appearance.
    n_clusters_ : int
    threshold_ : float
        Distance threshold of the partition (for one cluster, the top merge
        height: the lowest threshold giving one cluster).
    ch_score_ : float or None
        CH index of the partition, computed from the bits; None for one cluster.
    linkage_ : ndarray, shape (n_clients - 1, 4)
        The Ward dendrogram (scipy format).
    distances_ : ndarray of int32
        Condensed pairwise Hamming distances.
    search_ : list of dict
        One ``{"threshold", "ch", "n_clusters", "valid"}`` per probe, in
        order (the first ``n_initial_points`` are the random ones); ``ch`` is
        None when the cut has a single cluster.
    threshold_range_ : (float, float) or None
        The range searched; None when no search ran.
    max_ch_ : float
        Highest CH over every valid cut of the dendrogram (0.0 if none): what
        the probes could at best have found.
    null_ch_ : ndarray
        The test statistic on each permuted data set (empty when not run).
    null_observed_ch_ : float or None
        The same statistic on the unpermuted (possibly subsampled) data.
    null_pvalue_ : float or None
        ``(1 + #{null >= observed}) / (n_null + 1)``.
    centroids_ : ndarray, shape (n_clusters_, n_bits)
        Mean bit of each cluster.
    n_bits_ : int
    refinements_ : list of dict
        One ``{"depth", "size", "n_clusters", "pvalue"}`` per cluster that
        refinement examined.
    separations_ : list of dict
        One ``{"depth", "clusters", "sizes", "separation", "merged"}`` per pair
        of clusters the separation check measured, refinements' included.
    consolidated_ : int
        Clients the consolidation passes moved to a nearer cluster mean.
    sample_ : ndarray of int or None
        Rows clustered by the full method when the fleet was larger than
        ``max_exact_clients`` (the others were assigned); None otherwise.
        ``linkage_``, ``distances_`` and ``search_`` then describe the sample.

    Notes
    -----
    **Search range.** Cuts below the merge at which every cluster first
    reaches ``min_cluster_size`` are all invalid, and cuts at or above the top
    merge give one cluster. The default range is therefore ``[h_lo, h_top]``:
    ``h_lo`` the height of that first admissible merge, ``h_top`` the top
    merge height, searched log-uniformly. Ward heights grow with the sketch
    length and with cluster sizes, so the range follows both (the reference
    code's fixed (1, 100) does not).

    **One cluster or several.** CH compares k >= 2 clusters with each other
    and cannot score "one cluster", so maximising it always splits. The split
    is kept only if it beats a permutation null: each bit column is shuffled
    across clients independently, which keeps every bit's frequency but
    destroys any grouping of clients. The statistic is the highest CH over all
    admissible cuts of the Ward dendrogram (read off in O(n), so the null
    needs no optimiser runs), computed on the data and on ``n_null`` shuffled
    copies; the Monte Carlo p-value ``(1 + #{null >= observed}) / (n_null +
    1)`` must be at most ``single_cluster_alpha`` (with 19 copies and 0.05:
    the data must beat every copy, i.e. exceed the null's 95% quantile).
    Above ``null_max_clients`` clients the test runs on a random subset of
    that size, with ``min_cluster_size`` scaled by the subset fraction; the
    test stays exact, only its power depends on the subset. The shuffle also
    breaks correlations between bits inside a sketch, so structure that is
    not a grouping (a continuum of clients) can also pass the test.

    Clients also form one cluster when there are fewer than
    ``2 * min_cluster_size`` of them, when all sketches are identical, or
    when no probed threshold is admissible.

    The partition chosen is the best probe actually evaluated (the objective
    is exact and cheap), not the surrogate's arg-max as in the paper's
    Algorithm 2 line 11.

    **Nested groups (``refine``).** CH weighs a split by the spread it
    explains, so when groups are nested (two pairs of close groups, as the
    digits rotated by 0/180 and 90/270 degrees whose sketches are 23 bits
    apart inside a pair and 79 across) it keeps the top split and never sees
    the inner one, even without bit flips. Refinement applies the same
    procedure inside each cluster: a cluster is split only if, on its own, its
    best CH beats the permutation null, so homogeneous clusters stay whole
    (the test is the guard against over-splitting; its level is divided by the
    number of clusters examined, Bonferroni, with the permutations raised to
    match). This is an extension of the paper's method; ``refine=False``
    restores the flat choice.

    **Separated clusters, not only significant ones.** The permutation test
    asks whether there is *any* structure, and with enough clients it finds
    some inside one true group as well (clients with fewer samples have
    noisier class means, some miss classes): at 1,000 digits devices in 4
    rotation groups, refinement alone split one group into 5 (ARI 0.86). Each
    cut is therefore also checked for an effect size: two clusters are kept
    apart only when their separation (the held-out projection on the line
    joining them, cut by 1-D 2-means, in units of the pooled standard
    deviation) reaches ``min_separation``. One blob cut in two measures about
    2.7 (3.5 for a uniform continuum) at any size; the closest real pair of
    the fleet benchmark about 8. See :mod:`server_kit.clustering.separation`.

    The permutation test stops early (Besag and Clifford's sequential Monte
    Carlo test) as soon as more null values reach the observed statistic
    than the level allows: the decision is the same as with all ``n_null``
    permutations, and homogeneous sets cost a few permutations.
    """

    def __init__(
        self,
        *,
        min_cluster_size: int = 2,
        n_calls: int = 35,
        n_initial_points: int = 30,
        acq_func: str = "LCB",
        kappa: float = 1.96,
        threshold_range: tuple[float, float] | None = None,
        single_cluster_alpha: float = 0.05,
        n_null: int = 19,
        null_max_clients: int = 500,
        refine: bool = True,
        max_depth: int = 4,
        min_separation: float | None = MIN_SEPARATION,
        consolidate: int = 10,
        max_exact_clients: int | None = MAX_EXACT_CLIENTS,
        random_state: int | np.random.RandomState | None = None,
    ) -> None:
        self.min_cluster_size = min_cluster_size
        self.n_calls = n_calls
        self.n_initial_points = n_initial_points
        self.acq_func = acq_func
        self.kappa = kappa
        self.threshold_range = threshold_range
        self.single_cluster_alpha = single_cluster_alpha
        self.n_null = n_null
        self.null_max_clients = null_max_clients
        self.refine = refine
        self.max_depth = max_depth
        self.min_separation = min_separation
        self.consolidate = consolidate
        self.max_exact_clients = max_exact_clients
        self.random_state = random_state

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"SketchClustering({params})"

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor arguments (scikit-learn convention)."""
        names = (
            "min_cluster_size", "n_calls", "n_initial_points", "acq_func", "kappa",
            "threshold_range", "single_cluster_alpha", "n_null", "null_max_clients",
            "refine", "max_depth", "min_separation", "consolidate", "max_exact_clients", "random_state",
        )  # fmt: skip
        return {name: getattr(self, name) for name in names}

    # ---------------------------------------------------------------- checks

    def _validate_params(self) -> None:
        check_int(self.min_cluster_size, "min_cluster_size", 1)
        check_int(self.n_calls, "n_calls", 1)
        check_int(self.max_depth, "max_depth", 0)
        if not isinstance(self.refine, (bool, np.bool_)):
            raise ValueError(f"refine must be True or False, got {self.refine!r}")
        check_int(self.n_initial_points, "n_initial_points", 1)
        if self.n_initial_points > self.n_calls:
            raise ValueError(
                f"n_initial_points must be at most n_calls ({self.n_calls}), "
                f"got {self.n_initial_points}"
            )
        if self.acq_func not in ACQ_FUNCS:
            raise ValueError(f"acq_func must be one of {ACQ_FUNCS}, got {self.acq_func!r}")
        kappa = self.kappa
        if (
            isinstance(kappa, bool)
            or not isinstance(kappa, numbers.Real)
            or not kappa >= 0
            or not np.isfinite(kappa)
        ):
            raise ValueError(f"kappa must be a finite number >= 0, got {kappa!r}")
        rng_ = self.threshold_range
        if rng_ is not None:
            ok = isinstance(rng_, (tuple, list)) and len(rng_) == 2
            ok = ok and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in rng_)
            if not ok or not (0 < rng_[0] < rng_[1] < np.inf):
                raise ValueError(
                    f"threshold_range must be None or a pair (low, high) with 0 < low < high, got {rng_!r}"
                )
        alpha = self.single_cluster_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < 1:
            raise ValueError(f"single_cluster_alpha must be a number in (0, 1), got {alpha!r}")
        check_int(self.n_null, "n_null", 0)
        if self.n_null and (self.n_null + 1) * alpha < 1 - 1e-9:
            need = int(np.ceil(1 / alpha - 1 - 1e-9))
            raise ValueError(
                f"n_null must be 0 (no test) or at least {need} for single_cluster_alpha={alpha}: "
                f"the smallest p-value is 1 / (n_null + 1), got n_null={self.n_null}"
            )
        check_int(self.null_max_clients, "null_max_clients", 10)
        sep = self.min_separation
        if sep is not None and (isinstance(sep, bool) or not isinstance(sep, numbers.Real)
                                or not 0 <= sep < np.inf):
            raise ValueError(f"min_separation must be None or a finite number >= 0, got {sep!r}")
        check_int(self.consolidate, "consolidate", 0)
        if self.max_exact_clients is not None:
            check_int(self.max_exact_clients, "max_exact_clients", 100)

    def _check_packed(self, packed: Any, n_bits: int | None) -> np.ndarray:
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

    # ------------------------------------------------------------------- fit

    def fit(self, packed: np.ndarray, n_bits: int) -> SketchClustering:
        """Cluster the clients whose packed sketches are the rows of ``packed``.

        Parameters
        ----------
        packed : ndarray of uint8, shape (n_clients, ceil(n_bits / 8))
            One packed sketch per client (:func:`edge_sdk.stack_sketches`).
        n_bits : int
            Meaningful bits per sketch; padding bits are ignored.

        Returns
        -------
        self
        """
        self._validate_params()
        check_int(n_bits, "n_bits", 1)
        n_bits = int(n_bits)
        p = self._check_packed(packed, n_bits)
        n = p.shape[0]
        if n == 0:
            raise ValueError("packed holds no sketches: need at least one client")
        rs = check_random_state(self.random_state)
        mcs = int(self.min_cluster_size)
        t0 = time.perf_counter()
        self.sample_: np.ndarray | None = None
        self.separations_: list[dict[str, Any]] = []
        if self.max_exact_clients is not None and n > int(self.max_exact_clients):
            return self._fit_sampled(p, n_bits, rs, t0)

        bits = _bits.unpack_bits(p, n_bits)
        self.n_bits_ = n_bits
        self.search_: list[dict[str, Any]] = []
        self.threshold_range_: tuple[float, float] | None = None
        self.max_ch_ = 0.0
        self.null_ch_ = np.empty(0)
        self.null_observed_ch_: float | None = None
        self.null_pvalue_: float | None = None
        self.refinements_: list[dict[str, Any]] = []
        self.consolidated_ = 0
        if n == 1:
            self.distances_ = np.empty(0, dtype=np.int32)
            self.linkage_ = np.empty((0, 4))
            return self._finish_single(bits, "a single client", t0)

        # Memory: scipy's linkage copies its float64 input, so at peak the
        # process holds two float64 condensed arrays (2 x 8 bytes per pair).
        # The int32 distances are dropped meanwhile and rebuilt exactly from
        # the square roots, which saves 4 bytes per pair (1.8 GB at 30,000).
        d = _bits.hamming_pdist(p, n_bits)
        t1 = time.perf_counter()
        roots = _sqrt_float64(d)
        del d
        self.linkage_ = linkage(roots, method="ward")
        t2 = time.perf_counter()
        self.distances_ = _square_int32(roots)
        del roots
        log.debug("distances %.3f s, Ward linkage %.3f s", t1 - t0, t2 - t1)
        profile = cut_profile(self.linkage_, mcs)
        self.max_ch_ = profile.best()[1]
        if n < 2 * mcs:
            return self._finish_single(bits, f"{n} clients < 2 * min_cluster_size", t0)
        if profile.heights[-1] == 0:
            return self._finish_single(bits, "all sketches identical", t0)

        if self.n_null:
            # the test reads every admissible cut of the dendrogram, not the
            # search's result, so it runs first: a homogeneous set skips the search
            t4 = time.perf_counter()
            self._null_test(bits, profile, rs)
            log.debug("permutation test %.3f s", time.perf_counter() - t4)
            if self.null_pvalue_ > self.single_cluster_alpha:
                return self._finish_single(bits, "permutation test: no cluster structure", t0)
        t3 = time.perf_counter()
        best = self._search(profile, rs)
        log.debug("threshold search %.3f s", time.perf_counter() - t3)
        if best is None:
            return self._finish_single(bits, "no admissible threshold probed", t0)

        self.threshold_ = float(best["threshold"])
        labels = _relabel(fcluster(self.linkage_, self.threshold_, criterion="distance"))
        k = int(labels.max()) + 1
        if k != best["n_clusters"]:  # pragma: no cover - would be a scipy change
            raise RuntimeError(
                f"fcluster gave {k} clusters where the dendrogram gives {best['n_clusters']}"
            )
        if self.min_separation and (np.bincount(labels) >= MIN_SIDE).sum() >= 2:  # else nothing to measure
            merged, pairs = merge_inseparable(bits, labels, float(self.min_separation),
                                              np.random.default_rng(rs.randint(2**31 - 1)))
            labels = _relabel(merged)
            self.separations_.extend({"depth": self._depth, **pair} for pair in pairs)
            k = int(labels.max()) + 1
            if k == 1:
                return self._finish_single(bits, "no two clusters of the cut are separated", t0)
        if self.refine and self._depth < int(self.max_depth):
            labels = self._refined(p, n_bits, labels, rs)
            k = int(labels.max()) + 1
        if self._depth == 0 and self.consolidate and np.bincount(labels).min() >= MIN_SIDE:
            labels, self.consolidated_ = _consolidate(bits, labels, int(self.consolidate))
            k = int(labels.max()) + 1
        self.labels_ = labels
        self.n_clusters_ = k
        sums, counts = _cluster_sums(bits, labels, k)
        self.centroids_ = sums / counts[:, None]
        self.ch_score_ = calinski_harabasz_bits(bits, labels)
        self._log(t0, "several clusters")
        return self

    _depth = 0

    def _refined(self, packed: np.ndarray, n_bits: int, labels: np.ndarray, rs: Any) -> np.ndarray:
        """Split each large enough cluster again when its own test finds structure."""
        out = labels.copy()
        next_label = int(labels.max()) + 1
        sizes = np.bincount(labels)
        n_examined = max(1, int((sizes >= 2 * int(self.min_cluster_size)).sum()))
        for c in range(int(labels.max()) + 1):
            members = np.flatnonzero(labels == c)
            if members.size < 2 * int(self.min_cluster_size):
                continue
            # one test per examined cluster: Bonferroni over them, and enough
            # permutations for the smaller level to be reachable
            alpha = float(self.single_cluster_alpha) / n_examined
            params = {**self.get_params(), "random_state": int(rs.randint(2**31 - 1)),
                      "null_max_clients": min(int(self.null_max_clients), REFINE_NULL_MAX_CLIENTS),
                      "single_cluster_alpha": alpha,
                      "n_null": max(int(self.n_null), int(np.ceil(1.0 / alpha - 1e-9)) - 1)}
            child = SketchClustering(**params)
            child._depth = self._depth + 1
            with _quiet(log):
                child.fit(packed[members], n_bits)
            self.refinements_.append({"depth": child._depth, "size": int(members.size),
                                      "n_clusters": int(child.n_clusters_), "pvalue": child.null_pvalue_})
            self.refinements_.extend(child.refinements_)
            self.separations_.extend(child.separations_)
            if child.n_clusters_ > 1:
                for j in range(1, child.n_clusters_):
                    out[members[child.labels_ == j]] = next_label
                    next_label += 1
        return _relabel(out)

    def _fit_sampled(self, packed: np.ndarray, n_bits: int, rs: Any, t0: float) -> SketchClustering:
        """The full method on a seeded sample, then every other client to the nearest centroid."""
        n, m = packed.shape[0], int(self.max_exact_clients)
        rng = np.random.default_rng(rs.randint(0, 2**32 - 1, size=4, dtype=np.uint64))
        sample = np.sort(rng.choice(n, size=m, replace=False))
        mcs = int(self.min_cluster_size)
        # a cluster of min_cluster_size clients holds about mcs * m / n of the sample
        params = {**self.get_params(), "max_exact_clients": None, "random_state": int(rs.randint(2**31 - 1)),
                  "min_cluster_size": min(mcs, max(2, round(mcs * m / n)))}
        inner = SketchClustering(**params).fit(packed[sample], n_bits)
        for name in ("linkage_", "distances_", "search_", "threshold_range_", "max_ch_", "null_ch_",
                     "null_observed_ch_", "null_pvalue_", "refinements_", "separations_", "threshold_",
                     "consolidated_"):
            setattr(self, name, getattr(inner, name))
        self.n_bits_ = n_bits
        self.centroids_ = inner.centroids_
        labels = self.predict(packed)
        labels[sample] = inner.labels_  # the sample keeps the full method's choice
        labels = _relabel(labels)
        k = int(labels.max()) + 1
        sums, counts = _packed_cluster_sums(packed, n_bits, labels, k)
        self.labels_ = labels
        self.n_clusters_ = k
        self.centroids_ = sums / counts[:, None]
        self.ch_score_ = None if k < 2 else _ch_from_sums(sums, counts)
        self.sample_ = sample
        self._log(t0, f"{m} sampled with the full method, {n - m} assigned to the nearest centroid")
        return self

    def _finish_single(self, bits: np.ndarray, reason: str, t0: float) -> SketchClustering:
        n = bits.shape[0]
        self.labels_ = np.zeros(n, dtype=np.intp)
        self.n_clusters_ = 1
        self.threshold_ = float(self.linkage_[-1, 2]) if n > 1 else 0.0
        self.ch_score_ = None
        self.centroids_ = bits.mean(axis=0, dtype=np.float64)[None, :]
        self._log(t0, f"one cluster ({reason})")
        return self

    def _log(self, t0: float, verdict: str) -> None:
        n_valid = sum(1 for s in self.search_ if s["valid"])
        ch = "n/a" if self.ch_score_ is None else f"{self.ch_score_:.4g}"
        if self.null_pvalue_ is None:
            null = "null test not run"
        else:
            null = (
                f"null test: observed {self.null_observed_ch_:.4g} vs null max "
                f"{self.null_ch_.max():.4g} over {self.null_ch_.size} permutations, "
                f"p = {self.null_pvalue_:.3g}"
            )
        log.info(
            "%d clients: %d probes (%d admissible), threshold %.4g -> k = %d, CH %s; %s; %s (%.3f s)",
            self.labels_.size,
            len(self.search_),
            n_valid,
            self.threshold_,
            self.n_clusters_,
            ch,
            null,
            verdict,
            time.perf_counter() - t0,
        )

    def _search(self, profile: CutProfile, rs: np.random.RandomState) -> dict[str, Any] | None:
        """Bayesian optimisation of CH over thresholds; the best admissible probe or None."""
        if self.threshold_range is not None:
            low, high = (float(v) for v in self.threshold_range)
        else:
            first = np.flatnonzero(profile.allowed)
            if first.size == 0:
                return None
            h = profile.heights
            low, high = float(h[first[0] - 1]) if first[0] > 0 else 0.0, float(h[-1])
            if low <= 0:
                positive = h[h > 0]
                low = float(positive[0]) / 2
            if not low < high:
                return None
        self.threshold_range_ = (low, high)

        from skopt import gp_minimize  # imported here: it takes most of a second
        from skopt.space import Real

        def objective(x: list[float]) -> float:
            t = float(x[0])
            m = profile.merges_at(t)
            k = int(profile.n_clusters[m])
            ok = bool(profile.allowed[m])
            ch = None if k < 2 else float(profile.ch[m])
            self.search_.append({"threshold": t, "ch": ch, "n_clusters": k, "valid": ok})
            # Inadmissible cuts score CH = 0, the worst any partition can get:
            # a huge constant would wreck the Gaussian process's scaling.
            return -ch if ok else 0.0

        # The GP works on 35 x 35 matrices: a multi-threaded BLAS only adds
        # thread hand-offs, which turn into long stalls on a busy machine.
        with threadpool_limits(limits=1, user_api="blas"):
            gp_minimize(
                objective,
                [Real(low, high, prior="log-uniform")],
                n_calls=int(self.n_calls),
                n_initial_points=int(self.n_initial_points),
                initial_point_generator="random",
                acq_func=self.acq_func,
                acq_optimizer="sampling",
                kappa=float(self.kappa),
                random_state=rs,
            )
        best = None
        for probe in self.search_:
            if probe["valid"] and (best is None or probe["ch"] > best["ch"]):
                best = probe
        return best

    def _null_test(self, bits: np.ndarray, profile: CutProfile, rs: np.random.RandomState) -> None:
        """Permutation test of "no grouping"; sets null_ch_, null_observed_ch_, null_pvalue_."""
        n, n_bits = bits.shape
        rng = np.random.default_rng(rs.randint(0, 2**32 - 1, size=4, dtype=np.uint64))
        mcs = int(self.min_cluster_size)
        if n > self.null_max_clients:
            m = int(self.null_max_clients)
            sample = bits[np.sort(rng.choice(n, size=m, replace=False))]
            mcs = min(mcs, max(2, round(mcs * m / n)))
            observed = _max_valid_ch(sample, n_bits, mcs)
        else:
            sample = bits
            observed = profile.best()[1]
        # Sequential Monte Carlo (Besag & Clifford 1991): the decision p <= alpha
        # tolerates at most `allowed` null values >= observed; once more have
        # been seen it cannot change, so the remaining permutations are skipped.
        # Homogeneous sets stop after a few; structured ones run all n_null.
        allowed = int(np.floor(self.single_cluster_alpha * (self.n_null + 1) + 1e-9)) - 1
        null: list[float] = []
        exceed = 0
        for _ in range(int(self.n_null)):
            v = _max_valid_ch(rng.permuted(sample, axis=0), n_bits, mcs)
            null.append(v)
            exceed += v >= observed
            if exceed > allowed:
                break
        self.null_ch_ = np.array(null)
        self.null_observed_ch_ = observed
        if len(null) == self.n_null:
            self.null_pvalue_ = (1 + exceed) / (self.n_null + 1)
        else:  # stopped early: the sequential p-value, above alpha by construction
            self.null_pvalue_ = exceed / len(null)

    @classmethod
    def from_centroids(cls, centroids: np.ndarray, n_bits: int, **params: Any) -> SketchClustering:
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

    def fit_predict(self, packed: np.ndarray, n_bits: int) -> np.ndarray:
        """Fit and return :attr:`labels_`."""
        return self.fit(packed, n_bits).labels_

    # --------------------------------------------------------------- predict

    def predict(self, packed: np.ndarray) -> np.ndarray:
        """Cluster of each new client: the nearest centroid, ties to the lower label.

        Distance is the squared Euclidean distance between the client's 0/1
        vector and each cluster's mean bit vector.
        """
        if not hasattr(self, "centroids_"):
            raise ValueError("this SketchClustering is not fitted yet: call fit first")
        p = self._check_packed(packed, self.n_bits_)
        c = self.centroids_
        cc = np.einsum("ij,ij->i", c, c)[None, :]
        tol = 1e-9 * max(1, self.n_bits_)
        out = np.empty(p.shape[0], dtype=np.intp)
        for i in range(0, p.shape[0], _PREDICT_CHUNK):  # O(chunk) memory for a million clients
            x = _bits.unpack_bits(p[i : i + _PREDICT_CHUNK], self.n_bits_).astype(np.float64)
            d = x.sum(axis=1)[:, None] - 2.0 * (x @ c.T) + cc
            out[i : i + x.shape[0]] = np.argmax(d <= d.min(axis=1, keepdims=True) + tol, axis=1)
        return out


# --------------------------------------------------------------------------
# Report figure
# --------------------------------------------------------------------------


def plot_search(model: SketchClustering, path: str | Path) -> Path:
    """Draw CH against threshold for every probe and the chosen threshold; save to ``path``.

    Admissible probes are dots (random ones hollow, guided ones filled),
    inadmissible ones grey crosses (at CH 0 when the cut is one cluster); the
    line is CH of every admissible cut of the dendrogram over the searched
    range. Uses the Agg canvas directly, so the global matplotlib backend is
    left alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    if not hasattr(model, "search_"):
        raise ValueError("the model is not fitted yet: call fit first")
    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    probes = model.search_
    n_init = int(model.n_initial_points)
    if model.threshold_range_ is not None and model.linkage_.shape[0] > 0:
        prof = cut_profile(model.linkage_, model.min_cluster_size)
        low, high = model.threshold_range_
        edges = np.concatenate(
            ([low], prof.heights[(prof.heights > low) & (prof.heights < high)], [high])
        )
        ys = [
            prof.ch[m] if prof.allowed[m] else np.nan
            for m in (prof.merges_at(t) for t in edges[:-1])
        ]
        ax.stairs(ys, edges, baseline=None, color="0.6", lw=0.8, label="every cut")
    for guided in (False, True):
        pts = [
            (s["threshold"], s["ch"])
            for i, s in enumerate(probes)
            if s["valid"] and (i >= n_init) == guided
        ]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(
                xs, ys, s=28, zorder=3,
                facecolors="C0" if guided else "none", edgecolors="C0",
                label="guided probe" if guided else "random probe",
            )  # fmt: skip
    bad = [(s["threshold"], s["ch"] or 0.0) for s in probes if not s["valid"]]
    if bad:
        xs, ys = zip(*bad)
        ax.scatter(xs, ys, marker="x", color="0.5", zorder=3, label="inadmissible probe")
    top_k = int(fcluster(model.linkage_, model.threshold_, criterion="distance").max()) if model.linkage_.size else 1
    label = f"chosen, k = {top_k}"
    if top_k != model.n_clusters_:
        label += f" (refined to k = {model.n_clusters_})"
    ax.axvline(model.threshold_, color="C3", ls="--", label=label)
    if probes:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("distance threshold (Ward merge height)")
    ax.set_ylabel("Calinski-Harabasz index")
    title = f"{model.labels_.size} clients x {model.n_bits_} bits"
    if getattr(model, "sample_", None) is not None:
        title += f" (dendrogram of a sample of {model.sample_.size})"
    if model.null_pvalue_ is not None:
        title += f"; permutation test p = {model.null_pvalue_:.3g}"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
