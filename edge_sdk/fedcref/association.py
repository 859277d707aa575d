"""FedCRef's association test: how alike two cluster models reconstruct one cluster's samples.

For the samples of a local cluster, the per-sample reconstruction errors of
the cluster's own model are compared with those of another client's model
(:func:`association_statistic`); the server joins two clusters when the
statistic is at most ``theta`` on both sides. :func:`node_key` names the
clusters, the vertices of that association graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..validation import check_choice
from .checks import check_alpha

__all__ = [
    "NORMALIZATIONS",
    "association_matrix",
    "association_statistic",
    "check_homes",
    "check_normalization",
    "community_check_matrix",
    "minmax_normalize",
    "node_key",
    "normalized_differences",
]

#: Normalisations of the association test (:func:`normalized_differences`).
NORMALIZATIONS: tuple[str, ...] = ("relative", "minmax")


def node_key(cid: str, q: int) -> str:
    """The id of local cluster ``q`` of client ``cid`` (a vertex of the association graph)."""
    return f"{cid}:{int(q)}"


def minmax_normalize(values: Any) -> np.ndarray:
    """Min-max scale a vector to [0, 1]; a constant vector maps to zeros.

    Parameters
    ----------
    values : array-like, shape (n,)
        Finite values.

    Returns
    -------
    numpy.ndarray
        ``(v - min) / (max - min)`` as float64.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        raise ValueError("cannot normalise an empty vector")
    lo, hi = float(v.min()), float(v.max())
    if not hi > lo:
        return np.zeros_like(v)
    return (v - lo) / (hi - lo)


def check_normalization(normalization: Any) -> str:
    """Validate the name of the association test's normalisation (:data:`NORMALIZATIONS`)."""
    check_choice(normalization, "normalization", NORMALIZATIONS, NORMALIZATIONS)
    return str(normalization)


def normalized_differences(own_errors: Any, external_errors: Any, normalization: str = "relative") -> np.ndarray:
    """Per-sample error differences ``|E_own - E_ext|`` scaled to [0, 1].

    ``"relative"`` (default): each difference divided by the larger of the two
    errors, ``|e - e'| / max(e, e')`` (0 where both are 0). ``"minmax"``:
    min-max scaled over the samples. See :func:`association_statistic` for
    why both exist.
    """
    norm = check_normalization(normalization)
    e1 = np.asarray(own_errors, dtype=np.float64).ravel()
    e2 = np.asarray(external_errors, dtype=np.float64).ravel()
    if e1.shape != e2.shape:
        raise ValueError(f"own and external errors differ in length: {e1.size} vs {e2.size}")
    if e1.size == 0:
        raise ValueError("the association test needs at least one sample")
    if not (np.isfinite(e1).all() and np.isfinite(e2).all()):
        raise ValueError("reconstruction errors contain NaN or Inf")
    if (e1 < 0).any() or (e2 < 0).any():
        raise ValueError("reconstruction errors must be non-negative")
    d = np.abs(e1 - e2)
    if norm == "minmax":
        return minmax_normalize(d)
    top = np.maximum(e1, e2)
    return np.divide(d, top, out=np.zeros_like(d), where=top > 0)


def association_statistic(own_errors: Any, external_errors: Any, alpha: float = 75.0,
                          normalization: str = "relative") -> float:
    """One side of FedCRef's association test (Eq. 2 and Step 3 of Phase 2).

    For the samples of a local cluster ``Q_iq``, ``own_errors`` are the
    per-sample reconstruction errors of the cluster's own model ``M_iq`` and
    ``external_errors`` those of a received model ``M_jp``. The statistic is
    ``Q_alpha(Normalize_[0,1](|E_iq->iq - E_jp->iq|))``: the ``alpha``-th
    percentile (numpy's linear interpolation) of the normalised absolute
    differences (:func:`normalized_differences`). The clusters associate when
    the statistic is at most ``theta`` on both sides.

    The paper does not say how ``Normalize_[0,1]`` scales; two readings are
    implemented. ``"minmax"`` scales the differences by their own minimum and
    maximum over the cluster. That statistic measures the *shape* of the
    difference distribution, not its size, and it shrinks as the cluster
    grows (the maximum stretches the scale): on MNIST clusters of 500 (AEs of
    20 epochs) it joins no two digits at ``theta = 0.2`` but only a third of
    the pairs of one digit, and a federation of 8 clients then finds 3 of its
    8 shared digits; on clusters of 45 to 90 scikit-learn digits it cannot
    tell a digit's pairs from the others at any ``theta``. ``"relative"``
    (the default) divides each difference by the larger of the two errors,
    ``|e - e'| / max(e, e')``, which is in [0, 1] by construction and reads
    as the paper's sentence: "at least ``alpha`` % of the samples are
    reconstructed by the other model within ``theta`` of the own model's
    error". On the same MNIST clusters it joins three quarters of a digit's
    pairs and still no two digits, and the 8-client federation finds all 8.

    Parameters
    ----------
    own_errors, external_errors : array-like, shape (n,)
        Per-sample errors (non-negative) on the same samples, in the same order.
    alpha : float
        Percentile in (0, 100].
    normalization : {"relative", "minmax"}
        How the differences are scaled to [0, 1].

    Returns
    -------
    float
        The statistic, in [0, 1].
    """
    a = check_alpha(alpha)
    return float(np.percentile(normalized_differences(own_errors, external_errors, normalization), a))


def association_matrix(labels: Any, own_errors: Mapping[int, np.ndarray], external_errors: Sequence[np.ndarray],
                       alpha: float = 75.0, normalization: str = "relative") -> np.ndarray:
    """A client's side of the association test: its clusters against every external model.

    Parameters
    ----------
    labels : numpy.ndarray of int, shape (n,)
        The client's local cluster of each sample.
    own_errors : mapping of int to numpy.ndarray
        Per own cluster ``q``, the errors of its own model on all ``n`` samples.
    external_errors : sequence of numpy.ndarray
        Per external model, its errors on all ``n`` samples.
    alpha, normalization
        As for :func:`association_statistic`.

    Returns
    -------
    numpy.ndarray of float32, shape (len(own_errors), len(external_errors))
        Entry ``[i, j]``: :func:`association_statistic` of the ``i``-th own
        cluster (in sorted order) against external model ``j``, on that
        cluster's samples; an empty cluster gives 1.0 (never associating).
    """
    own = sorted(own_errors)
    stat = np.ones((len(own), len(external_errors)), dtype=np.float32)
    for j, e_ext in enumerate(external_errors):
        for i, q in enumerate(own):
            mask = labels == q
            if mask.any():
                stat[i, j] = association_statistic(own_errors[q][mask], e_ext[mask], alpha, normalization)
    return stat


def check_homes(cid: str, members: Mapping[str, Sequence[str]]) -> dict[int, str]:
    """The community of each own cluster in the community check (``{q: "<g>"}``).

    Parameters
    ----------
    cid : str
        The client; nodes of other clients are skipped.
    members : mapping of str to sequence of str
        Member nodes per community id (``{"<g>": ["<cid>:<q>", ...]}``).
    """
    home: dict[int, str] = {}
    for g, keys in members.items():
        for k in keys:
            owner, _, q = str(k).rpartition(":")
            if owner == cid:
                home[int(q)] = str(g)
    return home


def community_check_matrix(cid: str, labels: Any, home: Mapping[int, str], community_errors: Mapping[str, np.ndarray],
                           alpha: float = 75.0, normalization: str = "relative") -> tuple[np.ndarray, list[str]]:
    """A client's side of the community check: each member cluster's community model against the others.

    For own cluster ``q`` in community ``home[q]``, entry ``[i, j]`` is
    :func:`association_statistic` on ``q``'s samples with the errors of its
    community's model in place of the cluster's own model and those of the
    ``j``-th community (sorted ids) as the external ones: the association
    test run between two community models, on the samples of one member.
    Both models were trained by FedAvg for the same rounds, so neither has
    the advantage a cluster's own model has on the samples it was fitted to.

    Parameters
    ----------
    cid : str
        The client.
    labels : numpy.ndarray of int, shape (n,)
        The client's local cluster of each sample.
    home : mapping of int to str
        Community of each own member cluster (:func:`check_homes`).
    community_errors : mapping of str to numpy.ndarray
        Per community id, its model's errors on all ``n`` samples.
    alpha, normalization
        As for :func:`association_statistic`.

    Returns
    -------
    stat : numpy.ndarray of float32, shape (len(home), len(community_errors))
        Rows in sorted cluster order, columns in sorted community order; 0
        against the cluster's own community, 1.0 for an empty cluster (never
        linking).
    clusters : list of str
        The node ids of the rows.
    """
    gs = sorted(community_errors)
    qs = sorted(home)
    stat = np.ones((len(qs), len(gs)), dtype=np.float32)
    for i, q in enumerate(qs):
        mask = labels == q
        own = home[q]
        if own not in community_errors:
            raise ValueError(f"cluster {q} is in community {own}, whose model is missing")
        if not mask.any():
            continue
        for j, g in enumerate(gs):
            stat[i, j] = 0.0 if g == own else association_statistic(
                community_errors[own][mask], community_errors[g][mask], alpha, normalization)
    return stat, [node_key(cid, q) for q in qs]
