"""One cut of an agglomerative tree, for the methods that cluster a distance matrix (Briggs, FLIS)."""

from __future__ import annotations

import numpy as np

__all__ = ["cut_tree"]


def cut_tree(distances: np.ndarray, threshold: float, linkage: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat clusters of the ``linkage`` tree of a square distance matrix, cut at ``threshold``.

    Two clusters merge while their linkage distance is at most the
    threshold. Returns ``(labels, linkage_matrix)``: labels from 0 in
    scipy's order (``fcluster - 1``); a single point gets label 0 and an
    empty (0, 4) matrix.
    """
    from scipy.cluster.hierarchy import fcluster
    from scipy.cluster.hierarchy import linkage as scipy_linkage
    from scipy.spatial.distance import squareform

    n = distances.shape[0]
    if n < 2:
        return np.zeros(n, dtype=np.int64), np.zeros((0, 4))
    z = scipy_linkage(squareform(distances, checks=False), method=linkage)
    return fcluster(z, t=float(threshold), criterion="distance").astype(np.int64) - 1, z
