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

Here is the estimator, :class:`SketchClustering`, which runs the steps in
order; each step has its module in this package (``dendrogram``, ``threshold``,
``permutation``, ``separation``, ``refine``, ``centroids``, ``sampled``).
The exact method's dendrogram and the choice of its cut run in ``exact``; the
fitted attributes and the fit's log line are set in ``fitted``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from sklearn.utils import check_random_state

from edge_sdk import bits as _bits
from edge_sdk.validation import check_int

from .centroids import NearestCentroids
from .dendrogram import relabel
from .exact import build_dendrogram, choose_cut
from .fitted import finish_several, finish_single, log_fit, start_fit
from .params import PARAM_NAMES, check_packed, check_params
from .refine import HARTIGAN_MAX_CLIENTS, QuietLogger, child_params, consolidate, consolidate_small
from .sampled import MAX_EXACT_CLIENTS, adopt_sample_fit, draw_sample, sample_params
from .separation import MIN_SEPARATION, MIN_SIDE

__all__ = ["SketchClustering"]

log = logging.getLogger(__name__)


class SketchClustering(NearestCentroids):
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
        After the final partition, passes that move clients Ward's greedy
        merges left in the farther cluster (at most this many passes; 0 keeps
        Ward's assignment). Where every cluster holds at least 20 clients:
        k-means passes on the bit means (every client to its nearest cluster
        mean). Where one is smaller (up to 2,000 clients): Hartigan's moves
        on Ward's own objective in the fit's distances
        (:func:`~server_kit.clustering.refine.hartigan_moves`), one client at
        a time, no cluster under ``min_cluster_size``.
    block_bits, noise_clip : int or None, default None
        Bits per class block (the latent size) and the clip of each block's
        Hamming distance (:mod:`server_kit.clustering.distances`), for the
        dendrogram and the permutation test. ``block_bits`` None: plain
        Hamming; ``noise_clip`` None: :func:`~.distances.default_noise_clip`
        (9 of 20 bits). :class:`server_kit.strategies.SketchClustered` passes
        the sketches' latent size (``clip_noise``).
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
        Condensed pairwise distances of the dendrogram: Hamming, or block-clipped (``noise_clip``).
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

    **No admissible cut.** On a few clients whose group sizes sit at
    ``min_cluster_size`` (15 OCFL clients, a group of 3, the rule at 3), one
    far client merges last and every cut of the dendrogram has a cluster of 1
    or 2. The statistic of the test and the partition then come from the
    cuts with their stragglers absorbed (:mod:`server_kit.clustering.absorbed`,
    up to 200 clients), for the data and every permuted copy alike.

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
        block_bits: int | None = None,
        noise_clip: int | None = None,
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
        self.block_bits = block_bits
        self.noise_clip = noise_clip
        self.random_state = random_state

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"SketchClustering({params})"

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor arguments (scikit-learn convention)."""
        return {name: getattr(self, name) for name in PARAM_NAMES}

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
        check_params(self)
        check_int(n_bits, "n_bits", 1)
        n_bits = int(n_bits)
        p = check_packed(packed, n_bits)
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
        start_fit(self, n_bits)
        if n == 1:
            self.distances_ = np.empty(0, dtype=np.int32)
            self.linkage_ = np.empty((0, 4))
            return finish_single(self, bits, "a single client", t0)
        profile = build_dendrogram(self, p, n_bits, mcs, t0)
        if n < 2 * mcs:
            return finish_single(self, bits, f"{n} clients < 2 * min_cluster_size", t0)
        if profile.heights[-1] == 0:
            return finish_single(self, bits, "all sketches identical", t0)
        labels, reason = choose_cut(self, bits, profile, rs)
        if labels is None:
            return finish_single(self, bits, reason, t0)
        return self._finish_several(p, n_bits, bits, labels, rs, t0)

    _depth = 0

    def _finish_several(self, p: np.ndarray, n_bits: int, bits: np.ndarray, labels: np.ndarray,
                        rs: np.random.RandomState, t0: float) -> SketchClustering:
        """Refine and consolidate the cut's clusters, then set the fitted attributes."""
        if self.refine and self._depth < int(self.max_depth):
            labels = self._refined(p, n_bits, labels, rs)
        if self._depth == 0 and self.consolidate:
            if np.bincount(labels).min() >= MIN_SIDE:
                labels, self.consolidated_ = consolidate(bits, labels, int(self.consolidate))
            elif labels.size <= HARTIGAN_MAX_CLIENTS:
                labels, self.consolidated_ = consolidate_small(self.distances_, labels, int(self.consolidate),
                                                               int(self.min_cluster_size))
        return finish_several(self, bits, labels, t0)

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
            child = SketchClustering(**child_params(self.get_params(), n_examined, rs))
            child._depth = self._depth + 1
            with QuietLogger(log):
                child.fit(packed[members], n_bits)
            self.refinements_.append({"depth": child._depth, "size": int(members.size),
                                      "n_clusters": int(child.n_clusters_), "pvalue": child.null_pvalue_})
            self.refinements_.extend(child.refinements_)
            self.separations_.extend(child.separations_)
            if child.n_clusters_ > 1:
                for j in range(1, child.n_clusters_):
                    out[members[child.labels_ == j]] = next_label
                    next_label += 1
        return relabel(out)

    def _fit_sampled(self, packed: np.ndarray, n_bits: int, rs: Any, t0: float) -> SketchClustering:
        """The full method on a seeded sample, then every other client to the nearest centroid."""
        n, m = packed.shape[0], int(self.max_exact_clients)
        sample = draw_sample(n, m, rs)
        inner = SketchClustering(**sample_params(self.get_params(), n, m, rs)).fit(packed[sample], n_bits)
        adopt_sample_fit(self, inner, packed, n_bits, sample)
        log_fit(self, t0, f"{m} sampled with the full method, {n - m} assigned to the nearest centroid")
        return self

    def fit_predict(self, packed: np.ndarray, n_bits: int) -> np.ndarray:
        """Fit and return :attr:`labels_`."""
        return self.fit(packed, n_bits).labels_
