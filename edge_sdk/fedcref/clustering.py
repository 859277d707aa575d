"""A device's local clusterings in FedCRef: the initial one, the refined one, and their agreement.

* Phase 0, the initial clustering (:func:`initial_clustering`): K-means or
  Ward's hierarchical clustering (:func:`partition_points`) on latent codes
  (:func:`latent_codes`), ``K_i`` given or chosen by silhouette
  (:func:`estimate_n_clusters`); the paper's simulated "dirty" clustering
  (:func:`dirty_labels`); or labels given as they are.
* Phase 4, refinement: Algorithm 2 on a matrix of reconstruction errors
  (:func:`refine_labels`) over candidates that may join an own cluster's model
  with its communities' models (:func:`candidate_groups`), and the stability,
  the Hungarian-matched agreement of two labelings (:func:`hungarian_accuracy`).

scikit-learn and scipy are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from ..validation import check_choice, check_int
from .checks import check_dirtiness, check_k_range

__all__ = [
    "DEFAULT_ENCODERS",
    "INIT_METHODS",
    "POINT_METHODS",
    "candidate_groups",
    "check_init",
    "dirty_labels",
    "estimate_n_clusters",
    "hungarian_accuracy",
    "initial_clustering",
    "latent_codes",
    "partition_points",
    "refine_candidates",
    "refine_labels",
]

#: Initial clustering methods of :class:`~edge_sdk.fedcref.FedCRefClient`.
INIT_METHODS: tuple[str, ...] = ("kmeans", "ward", "dirty", "given")

#: The initial methods that cluster points (:func:`partition_points`); the others take labels.
POINT_METHODS: tuple[str, ...] = ("kmeans", "ward")

#: Ward's clustering keeps all pairwise distances: at most this many samples (100 MB of float64).
WARD_MAX_SAMPLES = 5000

#: Encoder artifact used by default for a flattened input size.
DEFAULT_ENCODERS: dict[int, str] = {64: "digits_encoder", 784: "fmnist_fc_encoder"}


def check_init(init: Any) -> str:
    """Validate the name of an initial clustering method (:data:`INIT_METHODS`)."""
    check_choice(init, "init", INIT_METHODS, INIT_METHODS)
    return init


def hungarian_accuracy(y_true: Any, y_pred: Any) -> float:
    """Clustering accuracy under the best one-to-one label matching (the paper's Eq. 6).

    ``max over matchings pi of mean(y_true == pi(y_pred))``, the matching
    found by the Hungarian algorithm (:func:`scipy.optimize.linear_sum_assignment`)
    on the contingency table. With more predicted clusters than true ones the
    unmatched clusters count as errors.

    Parameters
    ----------
    y_true, y_pred : array-like of int, shape (n,)
        Two labelings of the same samples (any integer values).

    Returns
    -------
    float
        In [0, 1]; 1.0 for two labelings equal up to renaming.
    """
    from scipy.optimize import linear_sum_assignment

    t = np.asarray(y_true).ravel()
    p = np.asarray(y_pred).ravel()
    if t.shape != p.shape:
        raise ValueError(f"y_true and y_pred differ in length: {t.size} vs {p.size}")
    if t.size == 0:
        raise ValueError("clustering accuracy of no samples is undefined")
    t_vals, t_idx = np.unique(t, return_inverse=True)
    p_vals, p_idx = np.unique(p, return_inverse=True)
    table = np.zeros((len(p_vals), len(t_vals)), dtype=np.int64)
    np.add.at(table, (p_idx, t_idx), 1)
    rows, cols = linear_sum_assignment(table, maximize=True)
    return float(table[rows, cols].sum() / t.size)


def refine_labels(errors: Any, n_clusters: int) -> tuple[np.ndarray, list[int]]:
    """Algorithm 2 of the paper on a matrix of per-sample reconstruction errors.

    Starting with every sample unassigned, repeat ``n_clusters`` times: give
    every unassigned sample the model (among those not yet selected) that
    reconstructs it best, select the model chosen by the most samples, and
    assign it those samples. Samples still unassigned afterwards go to the
    selected model that reconstructs them best. Ties go to the lower column
    (put the local models first: they are the safeguard of the paper).

    Parameters
    ----------
    errors : array-like, shape (n_samples, n_models)
        ``errors[k, j]``: error of model ``j`` on sample ``k``; finite.
    n_clusters : int
        ``K_i``, the number of clusters to form; at most ``n_models``.

    Returns
    -------
    labels : numpy.ndarray of int64, shape (n_samples,)
        New cluster of each sample, ``0 .. len(selected) - 1``.
    selected : list of int
        Column of the model that defines each new cluster, in the order the
        clusters were formed. Shorter than ``n_clusters`` only when every
        sample was assigned before ``n_clusters`` models were selected.
    """
    e = np.asarray(errors, dtype=np.float64)
    if e.ndim != 2 or e.shape[0] == 0 or e.shape[1] == 0:
        raise ValueError(f"errors must be a non-empty (n_samples, n_models) matrix, got shape {e.shape}")
    if not np.isfinite(e).all():
        raise ValueError("errors contain NaN or Inf")
    k = check_int(n_clusters, "n_clusters")
    if k > e.shape[1]:
        raise ValueError(f"n_clusters ({k}) exceeds the number of models ({e.shape[1]})")
    n, m = e.shape
    labels = np.full(n, -1, dtype=np.int64)
    available = np.ones(m, dtype=bool)
    selected: list[int] = []
    for p in range(k):
        rest = np.flatnonzero(labels < 0)
        if rest.size == 0:
            break
        cols = np.flatnonzero(available)
        best = cols[np.argmin(e[np.ix_(rest, cols)], axis=1)]
        counts = np.bincount(best, minlength=m)
        winner = int(np.argmax(counts))
        labels[rest[best == winner]] = p
        available[winner] = False
        selected.append(winner)
    rest = np.flatnonzero(labels < 0)
    if rest.size:
        labels[rest] = np.argmin(e[np.ix_(rest, selected)], axis=1)
    return labels, selected


def refine_candidates(errors: np.ndarray, groups: Sequence[Sequence[int]],
                      n_clusters: int) -> tuple[np.ndarray, list[int], list[list[int]]]:
    """Algorithm 2 over candidates, each a group of columns of ``errors`` (see :func:`candidate_groups`).

    A candidate's error on a sample is the lowest of its columns'.
    :func:`refine_labels` forms at most ``n_clusters`` new clusters from the
    candidates; the model representing a new cluster is the column of its
    candidate with the lowest mean error on the cluster's samples (the
    candidate's first column when the cluster is empty).

    Returns
    -------
    labels : numpy.ndarray of int64, shape (n_samples,)
        New cluster of each sample.
    columns : list of int
        Column of the model representing each new cluster.
    chosen : list of list of int
        The candidate (its columns) behind each new cluster.
    """
    cand = np.stack([errors[:, grp].min(axis=1) for grp in groups], axis=1)
    new, selected = refine_labels(cand, min(n_clusters, len(groups)))
    chosen = [groups[c] for c in selected]
    columns = []
    for p, grp in enumerate(chosen):
        members = new == p
        columns.append(grp[int(np.argmin(errors[np.ix_(members, grp)].mean(axis=0)))] if members.any() else grp[0])
    return new, columns, chosen


def dirty_labels(y_true: Any, dirtiness: float, seed: int | None = 0) -> np.ndarray:
    """The paper's simulated initial clustering: true categories, each sample misassigned w.p. ``dirtiness``.

    The client's true categories become clusters ``0 .. K_i - 1`` (in sorted
    order); each sample independently moves, with probability ``dirtiness``,
    to one of the other clusters drawn uniformly. Only for experiments: it
    reads the true labels.

    Parameters
    ----------
    y_true : array-like of int, shape (n,)
        True categories of the client's samples (at least two distinct).
    dirtiness : float
        Misassignment probability in [0, 0.5] (the paper's range).
    seed : int or None
        Seed of the generator.

    Returns
    -------
    numpy.ndarray of int64
    """
    check_dirtiness(dirtiness)
    _, labels = np.unique(np.asarray(y_true).ravel(), return_inverse=True)
    k = int(labels.max()) + 1 if labels.size else 0
    if k < 2:
        raise ValueError(f"dirty initialisation needs at least two true categories, got {k}")
    rng = np.random.default_rng(seed)
    flip = rng.random(labels.size) < float(dirtiness)
    shift = rng.integers(1, k, size=labels.size)
    out = labels.astype(np.int64).copy()
    out[flip] = (labels[flip] + shift[flip]) % k
    return out


def partition_points(z: np.ndarray, k: int, method: str = "kmeans", *, seed: int | None = 0,
                     n_init: int = 10) -> np.ndarray:
    """``k`` clusters of the rows of ``z`` by K-means or by Ward's hierarchical clustering.

    Parameters
    ----------
    z : numpy.ndarray, shape (n, d)
        Points to cluster (latent codes or pixels).
    k : int
        Number of clusters, at most ``n``.
    method : {"kmeans", "ward"}
        ``"kmeans"``: Lloyd's K-means with ``n_init`` restarts from ``seed``.
        ``"ward"``: agglomerative clustering with Ward's linkage cut at ``k``
        clusters (deterministic; it holds all pairwise distances, so at most
        :data:`WARD_MAX_SAMPLES` samples). K-means cuts a digit's
        handwriting styles into spheres of equal spread; Ward merges the
        densest neighbourhoods first and follows the classes' shapes better
        on MNIST pixels (benchmarks/RESULTS.md, FedCRef on MNIST).
    seed, n_init : int
        K-means' seed and restarts (Ward ignores them).

    Returns
    -------
    numpy.ndarray of int64, shape (n,)
    """
    check_choice(method, "method", POINT_METHODS, POINT_METHODS)
    if method == "ward":
        if z.shape[0] > WARD_MAX_SAMPLES:
            raise ValueError(f"Ward's clustering holds every pairwise distance: {z.shape[0]} samples are more "
                             f"than {WARD_MAX_SAMPLES}; use init='kmeans'")
        from sklearn.cluster import AgglomerativeClustering

        return AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(z).astype(np.int64)
    from sklearn.cluster import KMeans

    return KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit_predict(z).astype(np.int64)


def estimate_n_clusters(
    z: Any, k_range: Sequence[int] = (2, 5), *, seed: int | None = 0, sample_size: int = 2000, n_init: int = 10,
    method: str = "kmeans",
) -> tuple[int, np.ndarray, dict[int, float]]:
    """Cluster for every ``K`` in ``k_range``; keep the ``K`` with the best silhouette.

    Parameters
    ----------
    z : array-like, shape (n, d)
        Points to cluster (latent codes or pixels).
    k_range : (int, int)
        Smallest and largest ``K`` tried (inclusive), ``2 <= min <= max``;
        ``max`` is capped at ``n - 1``.
    seed : int or None
        K-means and silhouette sampling seed.
    sample_size : int
        Silhouette on at most this many points (it is quadratic).
    n_init : int
        K-means restarts.
    method : {"kmeans", "ward"}
        How each ``K`` is clustered (:func:`partition_points`).

    Returns
    -------
    k : int
        The chosen number of clusters.
    labels : numpy.ndarray of int64
        Its labels.
    scores : dict
        Silhouette per ``K`` tried.
    """
    from sklearn.metrics import silhouette_score

    lo, hi = check_k_range(k_range)
    pts = np.asarray(z, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[0] < 3:
        raise ValueError(f"need at least 3 points as an (n, d) array to estimate K, got shape {pts.shape}")
    hi = min(hi, pts.shape[0] - 1)
    if hi < lo:
        raise ValueError(f"{pts.shape[0]} points are too few for k_range {tuple(k_range)!r}")
    best: tuple[float, int, np.ndarray] | None = None
    scores: dict[int, float] = {}
    for k in range(lo, hi + 1):
        labels = partition_points(pts, k, method, seed=seed, n_init=n_init)
        if len(np.unique(labels)) < 2:
            continue
        s = float(silhouette_score(pts, labels, sample_size=min(sample_size, pts.shape[0]), random_state=seed))
        scores[k] = s
        if best is None or s > best[0]:
            best = (s, k, labels)
    if best is None:
        raise ValueError(f"{method} found a single cluster for every K: the points are all equal")
    return best[1], best[2].astype(np.int64), scores


def latent_codes(x: np.ndarray, latents: Any = None, encoder: Any = "auto") -> np.ndarray:
    """The points K-means runs on: ``latents`` when given, else the encoder's codes of ``x``, else ``x``.

    Parameters
    ----------
    x : numpy.ndarray, shape (n, d)
        The device's flattened samples.
    latents : array-like, optional
        Precomputed latent codes, shape ``(n, d')``.
    encoder : "auto", str, object or None
        An object with ``encode(x) -> (n, d')`` (reshaped to its
        ``input_shape`` when it has one), an artifact name for
        :class:`~edge_sdk.encoder.OnnxEncoder`, ``"auto"`` (the default
        encoder of :data:`DEFAULT_ENCODERS` for ``d``, pixels without one) or
        None (pixels).

    Returns
    -------
    numpy.ndarray of float64, shape (n, d')
    """
    if latents is not None:
        z = np.asarray(latents, dtype=np.float64)
        if z.ndim != 2 or z.shape[0] != x.shape[0]:
            raise ValueError(f"latents must have shape ({x.shape[0]}, d), got {z.shape}")
        return z
    enc = encoder
    if isinstance(enc, str):
        name = DEFAULT_ENCODERS.get(x.shape[1]) if enc == "auto" else enc
        if name is None:
            return x.astype(np.float64)
        from ..encoder import OnnxEncoder

        enc = OnnxEncoder(name, threads=1)
    if enc is None:
        return x.astype(np.float64)
    shape = getattr(enc, "input_shape", None)
    xs = x if shape is None else x.reshape((x.shape[0],) + tuple(shape))
    return np.asarray(enc.encode(xs), dtype=np.float64)


def initial_clustering(
    x: np.ndarray,
    init: str,
    *,
    n_clusters: Optional[int] = None,
    k_range: Sequence[int] = (2, 5),
    encoder: Any = "auto",
    latents: Any = None,
    true_labels: Any = None,
    initial_labels: Any = None,
    dirtiness: float = 0.3,
    seed: int = 0,
) -> tuple[np.ndarray, Optional[np.ndarray], Optional[dict[int, float]]]:
    """Phase 0: a device's initial local clustering (see :class:`~edge_sdk.fedcref.FedCRefClient`).

    Parameters
    ----------
    x : numpy.ndarray, shape (n, d)
        The device's flattened samples.
    init : {"kmeans", "ward", "dirty", "given"}
        K-means or Ward (:func:`partition_points`) on :func:`latent_codes`
        (``n_clusters`` clusters, or chosen by silhouette over ``k_range``);
        :func:`dirty_labels` of
        ``true_labels``; or ``initial_labels`` as they are.
    n_clusters, k_range, encoder, latents, true_labels, initial_labels, dirtiness, seed
        As for :class:`~edge_sdk.fedcref.FedCRefClient`.

    Returns
    -------
    labels : numpy.ndarray of int
        One label per sample (not yet made consecutive).
    latents : numpy.ndarray of float32 or None
        The codes K-means or Ward ran on (None for dirty and given labels).
    silhouette : dict of int to float, or None
        Silhouette per ``K`` tried (None unless ``K`` was chosen by silhouette).
    """
    if init in POINT_METHODS:
        z = latent_codes(x, latents, encoder)
        if n_clusters is None:
            _, labels, scores = estimate_n_clusters(z, k_range, seed=seed, method=init)
            return labels, z.astype(np.float32), scores
        if n_clusters > x.shape[0]:
            raise ValueError(f"n_clusters ({n_clusters}) exceeds the {x.shape[0]} samples")
        return partition_points(z, n_clusters, init, seed=seed), z.astype(np.float32), None
    if init == "dirty":
        if true_labels is None:
            raise ValueError("init='dirty' needs true_labels (it simulates a noisy clustering of them)")
        y = np.asarray(true_labels).ravel()
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"true_labels has {y.shape[0]} entries for {x.shape[0]} samples")
        return dirty_labels(y, dirtiness, seed=seed), None, None
    if initial_labels is None:
        raise ValueError("init='given' needs initial_labels")
    labels = np.asarray(initial_labels).ravel()
    if labels.shape[0] != x.shape[0] or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"initial_labels must be {x.shape[0]} integers, got {labels.dtype} {labels.shape}")
    return labels, None, None


def candidate_groups(cid: str, own: Sequence[int], gs: Sequence[int],
                     members: Mapping[str, Sequence[str]]) -> list[list[int]]:
    """Columns of the refinement's error matrix grouped into candidates (own clusters linked to their communities).

    Columns ``0 .. len(own) - 1`` are the own clusters ``own``, the next ones
    the communities ``gs``. An own cluster and every community that lists it
    among its ``members`` (``{"<g>": [node ids]}``, node ids of client
    ``cid``) fall into one group; a group is a sorted list of columns, the
    groups ordered by their first column.
    """
    n_own = len(own)
    parent = list(range(n_own + len(gs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    pos = {q: i for i, q in enumerate(own)}
    for j, g in enumerate(gs):
        for key in members.get(str(g), []):
            owner, _, q = str(key).rpartition(":")
            if owner == cid and int(q) in pos:
                a, b = find(pos[int(q)]), find(n_own + j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(n_own + len(gs)):
        groups.setdefault(find(i), []).append(i)
    return [groups[r] for r in sorted(groups)]
