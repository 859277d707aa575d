"""The exact method's partition for :class:`~server_kit.clustering.sketch.SketchClustering`: a dendrogram, its cut.

:func:`build_dendrogram` computes the sketches' pairwise distances and their
one Ward dendrogram (``distances_``, ``linkage_``, ``max_ch_``);
:func:`choose_cut` then chooses its cut: the permutation test first (one
cluster or several), the threshold search (Bayesian optimisation of CH), the
separation check, each recorded on the estimator (``null_ch_``,
``null_observed_ch_``, ``null_pvalue_``, ``threshold_range_``, ``search_``,
``threshold_``, ``separations_``). Each step has its module (``distances``,
``dendrogram``, ``permutation``, ``threshold``, ``separation``); this one runs
them in order. Large fleets take a sample instead (:mod:`.sampled`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage

from .absorbed import absorbed_cut
from .dendrogram import CutProfile, cut_profile, relabel, sqrt_float64, square_int32
from .distances import sketch_pdist
from .permutation import permutation_test
from .separation import MIN_SIDE, merge_inseparable
from .threshold import bayes_search, search_range

__all__ = ["build_dendrogram", "choose_cut"]

# the estimator's one logger: a refinement quiets it (QuietLogger) while its children fit
log = logging.getLogger("server_kit.clustering.sketch")


def build_dendrogram(model: Any, p: np.ndarray, n_bits: int, mcs: int, t0: float) -> CutProfile:
    """Distances and the Ward dendrogram (``distances_``, ``linkage_``, ``max_ch_``); its cuts' profile."""
    # Memory: scipy's linkage copies its float64 input, so at peak the
    # process holds two float64 condensed arrays (2 x 8 bytes per pair).
    # The int32 distances are dropped meanwhile and rebuilt exactly from
    # the square roots, which saves 4 bytes per pair (1.8 GB at 30,000).
    d = sketch_pdist(p, n_bits, model.block_bits, model.noise_clip)
    t1 = time.perf_counter()
    roots = sqrt_float64(d)
    del d
    model.linkage_ = linkage(roots, method="ward")
    t2 = time.perf_counter()
    model.distances_ = square_int32(roots)
    del roots
    log.debug("distances %.3f s, Ward linkage %.3f s", t1 - t0, t2 - t1)
    profile = cut_profile(model.linkage_, mcs)
    model.max_ch_ = profile.best()[1]
    return profile


def choose_cut(model: Any, bits: np.ndarray, profile: CutProfile,
               rs: np.random.RandomState) -> tuple[np.ndarray | None, str]:
    """The permutation test, the threshold search (Bayesian optimisation of CH) and the separation check.

    Returns the labels of the chosen cut, or None and why the clients form one cluster.
    """
    # no cut meets the size rule: the cuts with their stragglers absorbed (small sets), for the test and the partition
    absorbed = None if profile.valid.any() else absorbed_cut(model.linkage_, model.distances_,
                                                             int(model.min_cluster_size))
    if model.n_null:
        # the test reads every admissible cut of the dendrogram, not the
        # search's result, so it runs first: a homogeneous set skips the search
        t4 = time.perf_counter()
        observed = profile.best()[1] if absorbed is None else absorbed.ch
        model.null_ch_, model.null_observed_ch_, model.null_pvalue_ = permutation_test(
            bits, observed, rs, min_cluster_size=model.min_cluster_size, null_max_clients=model.null_max_clients,
            single_cluster_alpha=model.single_cluster_alpha, n_null=model.n_null, block_bits=model.block_bits,
            noise_clip=model.noise_clip)
        log.debug("permutation test %.3f s", time.perf_counter() - t4)
        if model.null_pvalue_ > model.single_cluster_alpha:
            return None, "permutation test: no cluster structure"
    if absorbed is not None:
        model.threshold_ = absorbed.threshold
        labels = absorbed.labels
    else:
        t3 = time.perf_counter()
        best, found = None, search_range(profile, model.threshold_range)
        if found is not None:
            model.threshold_range_ = found
            best = bayes_search(profile, *found, model.search_, n_calls=int(model.n_calls),
                                n_initial_points=int(model.n_initial_points), acq_func=model.acq_func,
                                kappa=float(model.kappa), random_state=rs)
        log.debug("threshold search %.3f s", time.perf_counter() - t3)
        if best is None:
            return None, "no admissible threshold probed"
        model.threshold_ = best.threshold
        labels = relabel(fcluster(model.linkage_, model.threshold_, criterion="distance"))
        k = int(labels.max()) + 1
        if k != best.n_clusters:  # pragma: no cover - would be a scipy change
            raise RuntimeError(f"fcluster gave {k} clusters where the dendrogram gives {best.n_clusters}")
    if model.min_separation and (np.bincount(labels) >= MIN_SIDE).sum() >= 2:  # else nothing to measure
        merged, pairs = merge_inseparable(bits, labels, float(model.min_separation),
                                          np.random.default_rng(rs.randint(2**31 - 1)))
        labels = relabel(merged)
        model.separations_.extend({"depth": model._depth, **pair} for pair in pairs)
        if int(labels.max()) + 1 == 1:
            return None, "no two clusters of the cut are separated"
    return labels, ""
