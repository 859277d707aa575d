"""The permutation test of "one cluster": does the best cut beat bit columns shuffled across clients?

CH cannot score a single cluster, so maximising it always splits. The split
is kept only if the highest CH over the admissible cuts of the data's Ward
dendrogram beats the same statistic on copies whose bit columns are shuffled
independently (every bit's frequency kept, any grouping of clients
destroyed). See the Notes of :class:`~server_kit.clustering.sketch.SketchClustering`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .absorbed import absorbed_cut
from .dendrogram import CutProfile, cut_profile, ward_linkage
from .distances import bits_pdist

__all__ = ["best_ch", "max_valid_ch", "permutation_test"]


def best_ch(profile: CutProfile, linkage: np.ndarray, distances: np.ndarray, min_cluster_size: int) -> float:
    """The test's statistic: the highest CH over the valid cuts; where no cut is valid, the absorbed cut's
    (:func:`~.absorbed.absorbed_cut`, small sets only); 0 if neither exists."""
    if profile.valid.any():
        return profile.best()[1]
    found = absorbed_cut(linkage, distances, min_cluster_size)
    return 0.0 if found is None else found.ch


def max_valid_ch(bits: np.ndarray, n_bits: int, min_cluster_size: int, block_bits: int | None = None,
                 noise_clip: int | None = None) -> float:
    """:func:`best_ch` of the Ward dendrogram of 0/1 rows, on the fit's distances."""
    d = bits_pdist(bits, n_bits, block_bits, noise_clip)
    z = ward_linkage(d)
    return best_ch(cut_profile(z, min_cluster_size), z, d, min_cluster_size)


def permutation_test(bits: np.ndarray, observed: float, rs: np.random.RandomState, *,
                     min_cluster_size: Any, null_max_clients: Any, single_cluster_alpha: Any,
                     n_null: Any, block_bits: int | None = None,
                     noise_clip: int | None = None) -> tuple[np.ndarray, float, float]:
    """Permutation test of "no grouping": ``(null_ch, observed_ch, pvalue)``.

    ``observed``: :func:`best_ch` of the data's own dendrogram, which the
    caller has. Above ``null_max_clients`` clients the test runs on a random
    subset of that size, with ``min_cluster_size`` scaled by the subset
    fraction, and the statistic is taken on that subset instead.
    """
    n, n_bits = bits.shape
    rng = np.random.default_rng(rs.randint(0, 2**32 - 1, size=4, dtype=np.uint64))
    mcs = int(min_cluster_size)
    if n > null_max_clients:
        m = int(null_max_clients)
        sample = bits[np.sort(rng.choice(n, size=m, replace=False))]
        mcs = min(mcs, max(2, round(mcs * m / n)))
        observed = max_valid_ch(sample, n_bits, mcs, block_bits, noise_clip)
    else:
        sample = bits
    # Sequential Monte Carlo (Besag & Clifford 1991): the decision p <= alpha
    # tolerates at most `allowed` null values >= observed; once more have
    # been seen it cannot change, so the remaining permutations are skipped.
    # Homogeneous sets stop after a few; structured ones run all n_null.
    allowed = int(np.floor(single_cluster_alpha * (n_null + 1) + 1e-9)) - 1
    null: list[float] = []
    exceed = 0
    for _ in range(int(n_null)):
        v = max_valid_ch(rng.permuted(sample, axis=0), n_bits, mcs, block_bits, noise_clip)
        null.append(v)
        exceed += v >= observed
        if exceed > allowed:
            break
    if len(null) == n_null:
        pvalue = (1 + exceed) / (n_null + 1)
    else:  # stopped early: the sequential p-value, above alpha by construction
        pvalue = exceed / len(null)
    return np.array(null), observed, pvalue
