"""FedCRef on the device: local clusters, one small autoencoder per cluster, refinement.

FedCRef (Nardi, Valerio and Passarella, "Federated Clustering: An
Unsupervised Cluster-Wise Training for Decentralized Data Distributions")
clusters unlabelled data spread over many devices, each holding a few of many
unknown categories, without sharing data and without knowing how many
categories exist. This module is the device's side; the server's side (the
association graph, communities, FedAvg per community, the stopping rule and
the in-process driver) is :mod:`server_kit.fedcref`.

What a device does (Algorithm 1 and 2 of the paper):

1. Local initial clustering: K-means on the latent codes of an
   :class:`~edge_sdk.encoder.OnnxEncoder` (raw pixels without one), the
   number of clusters ``K_i`` given or chosen by silhouette
   (:func:`estimate_n_clusters`); or the paper's simulated "dirty"
   initialisation (:func:`dirty_labels`) for experiments.
2. One small autoencoder per local cluster (:data:`ARCHITECTURES`: the paper's
   784-100-64-32 with its mirror for 28x28 images, 64-48-32-16 for 8x8
   digits; ReLU, sigmoid output, Adam, MSE), trained on the device.
3. Its side of the bidirectional association test: for each own cluster
   ``Q_iq`` and each received model ``M_jp``, the ``alpha``-th percentile of
   the normalised per-sample differences ``|E_iq->iq - E_jp->iq|``
   (:func:`association_statistic`: relative to the errors by default, or
   min-max scaled); the server keeps the pairs where both sides are at most
   ``theta``.
4. FedAvg rounds for the communities its clusters belong to (local epochs on
   the member clusters' samples).
5. Refinement by lowest reconstruction error over its own and the
   community models (:func:`refine_labels`, Algorithm 2; an own cluster's
   model and its communities' models count as one candidate, see
   :meth:`FedCRefClient.refine`), and its stability, the Hungarian-matched
   agreement of its labels before and after (:func:`hungarian_accuracy`).

Every exchanged object is a pair ``(meta, tensors)``: a JSON-able dict and a
dict of numpy arrays, ready for :func:`edge_sdk.protocol.tensors_body` and
:func:`edge_sdk.protocol.encode_message`, so that the MQTT wiring is a thin
layer over :class:`FedCRefClient`.

A device without torch can still label new data with the exported community
models: :class:`OnnxCommunityLabeler` runs them with ONNX Runtime alone and
picks, per sample, the model with the lowest reconstruction error.

torch, scikit-learn and scipy are imported inside the functions that need
them: importing this module stays light.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ._validation import check_int, check_positive

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_ENCODERS",
    "INIT_METHODS",
    "NORMALIZATIONS",
    "FedCRefClient",
    "OnnxCommunityLabeler",
    "architecture_for",
    "association_statistic",
    "build_cluster_ae",
    "check_alpha",
    "check_normalization",
    "check_tau",
    "check_theta",
    "dirty_labels",
    "estimate_n_clusters",
    "hungarian_accuracy",
    "initial_ae_weights",
    "minmax_normalize",
    "normalized_differences",
    "node_key",
    "reconstruction_errors",
    "refine_labels",
    "join_models",
    "split_models",
    "train_cluster_ae",
]

log = logging.getLogger(__name__)

#: Autoencoder name -> layer widths of the encoder (the decoder mirrors it).
#: Hidden layers and the latent use ReLU, the output a sigmoid (the paper's
#: Table 2: 174,840 parameters for 784-100-64-32).
ARCHITECTURES: dict[str, tuple[int, ...]] = {
    "fedcref_ae_784_100_64_32": (784, 100, 64, 32),
    "fedcref_ae_64_48_32_16": (64, 48, 32, 16),
}

#: Normalisations of the association test (:func:`normalized_differences`).
NORMALIZATIONS: tuple[str, ...] = ("relative", "minmax")

#: Initial clustering methods of :class:`FedCRefClient`.
INIT_METHODS: tuple[str, ...] = ("kmeans", "dirty", "given")

#: Encoder artifact used by default for a flattened input size.
DEFAULT_ENCODERS: dict[int, str] = {64: "digits_encoder", 784: "fmnist_fc_encoder"}

Payload = tuple[dict[str, Any], dict[str, np.ndarray]]


# --------------------------------------------------------------------------- validation


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_alpha(alpha: Any) -> float:
    """Validate the association percentile ``alpha`` (in (0, 100]) and return it as float."""
    if not _is_number(alpha) or not math.isfinite(float(alpha)) or not 0.0 < float(alpha) <= 100.0:
        raise ValueError(
            f"alpha must be a percentile in (0, 100] (the paper uses 75), got {alpha!r}"
        )
    return float(alpha)


def check_theta(theta: Any) -> float:
    """Validate the association threshold ``theta`` (in (0, 1]) and return it as float."""
    if not _is_number(theta) or not math.isfinite(float(theta)) or not 0.0 < float(theta) <= 1.0:
        raise ValueError(
            f"theta must be an association threshold in (0, 1] on normalised error differences "
            f"(the paper uses 0.2), got {theta!r}"
        )
    return float(theta)


def check_tau(tau: Any) -> float:
    """Validate the stability threshold ``tau`` (in (0, 1]) and return it as float."""
    if not _is_number(tau) or not math.isfinite(float(tau)) or not 0.0 < float(tau) <= 1.0:
        raise ValueError(
            f"tau must be a stability threshold in (0, 1] on the clustering accuracy between "
            f"iterations (the paper uses 0.8), got {tau!r}"
        )
    return float(tau)


def _check_k_range(k_range: Any) -> tuple[int, int]:
    try:
        lo, hi = (int(k) for k in k_range)
    except (TypeError, ValueError):
        raise ValueError(f"k_range must be a pair (min, max) of cluster counts, got {k_range!r}") from None
    if lo < 2 or hi < lo:
        raise ValueError(f"k_range must satisfy 2 <= min <= max, got {k_range!r}")
    return lo, hi


def node_key(cid: str, q: int) -> str:
    """The id of local cluster ``q`` of client ``cid`` (a vertex of the association graph)."""
    return f"{cid}:{int(q)}"


# --------------------------------------------------------------------------- pure math


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
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
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
    if not _is_number(dirtiness) or not 0.0 <= float(dirtiness) <= 0.5:
        raise ValueError(f"dirtiness must be a probability in [0, 0.5], got {dirtiness!r}")
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


def estimate_n_clusters(
    z: Any, k_range: Sequence[int] = (2, 5), *, seed: int | None = 0, sample_size: int = 2000, n_init: int = 10
) -> tuple[int, np.ndarray, dict[int, float]]:
    """K-means for every ``K`` in ``k_range``; keep the one with the best silhouette.

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

    Returns
    -------
    k : int
        The chosen number of clusters.
    labels : numpy.ndarray of int64
        Its K-means labels.
    scores : dict
        Silhouette per ``K`` tried.
    """
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    lo, hi = _check_k_range(k_range)
    pts = np.asarray(z, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[0] < 3:
        raise ValueError(f"need at least 3 points as an (n, d) array to estimate K, got shape {pts.shape}")
    hi = min(hi, pts.shape[0] - 1)
    if hi < lo:
        raise ValueError(f"{pts.shape[0]} points are too few for k_range {tuple(k_range)!r}")
    best: tuple[float, int, np.ndarray] | None = None
    scores: dict[int, float] = {}
    for k in range(lo, hi + 1):
        labels = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit_predict(pts)
        if len(np.unique(labels)) < 2:
            continue
        s = float(silhouette_score(pts, labels, sample_size=min(sample_size, pts.shape[0]), random_state=seed))
        scores[k] = s
        if best is None or s > best[0]:
            best = (s, k, labels)
    if best is None:
        raise ValueError("K-means found a single cluster for every K: the points are all equal")
    return best[1], best[2].astype(np.int64), scores


def architecture_for(n_features: int) -> str:
    """The default cluster autoencoder for flattened inputs of ``n_features`` values."""
    for name, dims in ARCHITECTURES.items():
        if dims[0] == int(n_features):
            return name
    raise ValueError(
        f"no FedCRef autoencoder for {n_features} input features; known: "
        + ", ".join(f"{k} ({v[0]})" for k, v in ARCHITECTURES.items())
    )


def split_models(tensors: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Split ``{"<id>/<param>": array}`` back into ``{id: {param: array}}`` (see :func:`join_models`)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        key, sep, param = name.partition("/")
        if not sep or not key or not param:
            raise ValueError(f"tensor name {name!r} is not of the form '<model id>/<parameter>'")
        out.setdefault(key, {})[param] = arr
    return out


def join_models(models: Mapping[Any, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several models in one tensor dict, names prefixed ``"<id>/"``."""
    out: dict[str, np.ndarray] = {}
    for key, weights in models.items():
        for param, arr in weights.items():
            out[f"{key}/{param}"] = arr
    return out


# --------------------------------------------------------------------------- torch side


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the test environment has torch
        raise ImportError(
            "training FedCRef's cluster autoencoders needs torch; OnnxCommunityLabeler works without it"
        ) from e
    return torch


def build_cluster_ae(architecture: str) -> Any:
    """A fresh torch autoencoder of :data:`ARCHITECTURES` (random weights, caller's RNG).

    ``encoder`` is ``Linear, ReLU`` per layer down to the latent (ReLU
    included, as the paper's Table 2), ``decoder`` mirrors it and ends with a
    sigmoid; ``forward`` returns the flattened reconstruction.
    """
    torch = _import_torch()
    from torch import nn

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    dims = ARCHITECTURES[architecture]

    class ClusterAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_features = dims[0]
            enc: list[nn.Module] = []
            for a, b in zip(dims[:-1], dims[1:]):
                enc += [nn.Linear(a, b), nn.ReLU()]
            rev = dims[::-1]
            dec: list[nn.Module] = []
            for i, (a, b) in enumerate(zip(rev[:-1], rev[1:])):
                dec += [nn.Linear(a, b), nn.Sigmoid() if i == len(rev) - 2 else nn.ReLU()]
            self.encoder = nn.Sequential(*enc)
            self.decoder = nn.Sequential(*dec)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decoder(self.encoder(x.reshape(x.shape[0], -1)))

    return ClusterAE()


def _numpy_state(model: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().astype(np.float32, copy=True) for k, v in model.state_dict().items()}


def initial_ae_weights(architecture: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded initial weights (``torch.manual_seed(seed)`` then the constructor; caller's RNG kept)."""
    torch = _import_torch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return _numpy_state(build_cluster_ae(architecture))


@contextlib.contextmanager
def _threads(torch: Any, threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(check_int(threads, "threads"))
    try:
        yield
    finally:
        torch.set_num_threads(before)


_MODULES = threading.local()  # one evaluation module per architecture and thread


def _module(architecture: str, weights: Mapping[str, np.ndarray]) -> Any:
    """A cached module of ``architecture`` holding ``weights`` (eval mode), private to this thread."""
    torch = _import_torch()
    cache = getattr(_MODULES, "models", None)
    if cache is None:
        cache = _MODULES.models = {}
    model = cache.get(architecture)
    if model is None:
        with torch.random.fork_rng(devices=[]):
            model = build_cluster_ae(architecture)
        cache[architecture] = model
    try:
        model.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()},
                              strict=True)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"weights do not fit architecture {architecture!r}: {e}") from None
    return model.eval()


def _as_inputs(x: Any, n_features: int) -> np.ndarray:
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"x must be floating point in [0, 1], got dtype {arr.dtype}")
    if arr.ndim < 1 or arr.shape[0] == 0:
        raise ValueError(f"x holds no samples (shape {arr.shape})")
    flat = arr.reshape(arr.shape[0], -1)
    if flat.shape[1] != n_features:
        raise ValueError(f"x has {flat.shape[1]} values per sample, the autoencoder takes {n_features}")
    return np.ascontiguousarray(flat, dtype=np.float32)


def train_cluster_ae(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: Any,
    *,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 32,
    seed: int | None = 0,
    threads: int | None = None,
) -> tuple[dict[str, np.ndarray], float]:
    """Train an autoencoder from ``weights`` on samples ``x`` (Adam, MSE, shuffled mini-batches).

    Parameters
    ----------
    architecture : str
        A key of :data:`ARCHITECTURES`.
    weights : mapping of str to numpy.ndarray
        Starting ``state_dict`` (not modified).
    x : array-like, shape (n, ...)
        Samples in [0, 1], flattened to the architecture's input size.
    epochs, lr, batch_size : int, float, int
        Passes, Adam learning rate, mini-batch size.
    seed : int or None
        Seeds the shuffling (the caller's torch RNG is restored).
    threads : int, optional
        torch intra-op threads during the call.

    Returns
    -------
    weights : dict of str to numpy.ndarray
        Trained float32 ``state_dict``.
    loss : float
        Mean squared error per element over the last epoch.
    """
    torch = _import_torch()
    n_epochs = check_int(epochs, "epochs")
    bs = check_int(batch_size, "batch_size")
    rate = check_positive(lr, "lr")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    xa = _as_inputs(x, ARCHITECTURES[architecture][0])
    n = xa.shape[0]
    with _threads(torch, threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else int(seed))
        model = build_cluster_ae(architecture)
        try:
            model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in weights.items()},
                                  strict=True)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"weights do not fit architecture {architecture!r}: {e}") from None
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        opt = torch.optim.Adam(model.parameters(), lr=rate)
        xt = torch.from_numpy(xa)
        model.train()
        last = math.nan
        for _ in range(n_epochs):
            perm = torch.randperm(n, generator=gen)
            total = 0.0
            for start in range(0, n, bs):
                batch = xt[perm[start : start + bs]]
                opt.zero_grad(set_to_none=True)
                loss = torch.mean((model(batch) - batch) ** 2)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * batch.shape[0]
            last = total / n
        if not math.isfinite(last):
            raise RuntimeError(f"autoencoder training diverged (loss {last})")
        return _numpy_state(model), last


def reconstruction_errors(architecture: str, weights: Mapping[str, np.ndarray], x: Any,
                          *, chunk: int = 4096) -> np.ndarray:
    """Per-sample mean squared reconstruction error of an autoencoder (torch).

    Parameters
    ----------
    architecture : str
        A key of :data:`ARCHITECTURES`.
    weights : mapping of str to numpy.ndarray
        The model's ``state_dict``.
    x : array-like, shape (n, ...)
        Samples in [0, 1].
    chunk : int
        Samples per forward pass.

    Returns
    -------
    numpy.ndarray of float64, shape (n,)
    """
    torch = _import_torch()
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    xa = _as_inputs(x, ARCHITECTURES[architecture][0])
    model = _module(architecture, weights)
    out = np.empty(xa.shape[0], dtype=np.float64)
    with torch.no_grad():
        for start in range(0, xa.shape[0], chunk):
            xb = torch.from_numpy(xa[start : start + chunk])
            out[start : start + xb.shape[0]] = torch.mean((model(xb) - xb) ** 2, dim=1).double().numpy()
    return out


# --------------------------------------------------------------------------- the device


class FedCRefClient:
    """One device of a FedCRef federation: its data, clusters and cluster models.

    The server drives it through the methods below; each takes and returns
    ``(meta, tensors)`` pairs (a JSON-able dict, a dict of numpy arrays), the
    objects that travel on the wire.

    Parameters
    ----------
    cid : str
        Client id (a topic-safe word).
    x : array-like, shape (n, ...)
        Unlabelled samples, floating point in [0, 1] (8x8 or 28x28 images, or
        flat vectors of 64 or 784 values).
    n_clusters : int, optional
        ``K_i``. None: chosen by silhouette over ``k_range`` (K-means init);
        the number of true categories (dirty init); the number of distinct
        labels (given init).
    k_range : (int, int)
        Range of ``K_i`` tried by silhouette.
    init : {"kmeans", "dirty", "given"}
        Initial clustering: K-means on latent codes (or pixels); the
        paper's simulated dirty initialisation from ``true_labels``; or
        ``initial_labels`` as they are.
    encoder : "auto", str, object or None
        For K-means: an :class:`~edge_sdk.encoder.OnnxEncoder` (or any object
        with ``encode(x) -> (n, d)``), an artifact name, ``"auto"`` (the
        shipped ``digits_encoder`` for 64 features, ``fmnist_fc_encoder`` for
        784, pixels otherwise) or None (K-means on pixels).
    latents : array-like, optional
        Precomputed latent codes for K-means (skips the encoder).
    true_labels : array-like of int, optional
        True categories, read only by ``init="dirty"``.
    initial_labels : array-like of int, optional
        Labels for ``init="given"``.
    dirtiness : float
        Misassignment probability of the dirty initialisation, in [0, 0.5].
    architecture : str, optional
        Cluster autoencoder (:data:`ARCHITECTURES`); default by input size.
    epochs : int
        Local epochs of each cluster autoencoder (paper: 20).
    lr, batch_size : float, int
        Adam learning rate and mini-batch size.
    community_epochs : int
        Local epochs per community FedAvg round.
    alpha : float
        Percentile of the association test, in (0, 100] (paper: 75).
    normalization : {"relative", "minmax"}
        Scaling of the error differences in the association test (see
        :func:`association_statistic`; "minmax" is the other reading of the
        paper's Eq. 2).
    link_communities : bool
        In refinement, treat an own cluster's model and the models of the
        communities it belongs to as one candidate (see :meth:`refine`);
        False runs the paper's Algorithm 2 with every model a candidate.
    warm_start : bool
        Retrain a cluster's autoencoder from the model that defined the
        cluster at the last refinement instead of from the common seeded
        initialisation (the paper retrains; False).
    init_seed : int
        Seed of the initial autoencoder weights, the same on every device so
        that models start alike.
    seed : int
        The device's own randomness (K-means, dirty labels, shuffling).
    threads : int, optional
        torch intra-op threads while training and evaluating.

    Attributes
    ----------
    labels_ : numpy.ndarray of int64
        Current local clustering.
    initial_labels_ : numpy.ndarray of int64
        The initial clustering.
    n_clusters_ : int
        Current number of local clusters.
    latents_ : numpy.ndarray or None
        The latent codes K-means ran on (None for dirty/given init).
    models_ : dict of int to dict
        Current model of each local cluster.
    silhouette_ : dict of int to float
        Silhouette per K tried (K-means init with ``n_clusters=None``).
    stability_ : float or None
        Hungarian-matched agreement of the labels before and after the last
        refinement.
    train_seconds_, eval_seconds_ : float
        Time spent training autoencoders and computing reconstruction errors.

    Notes
    -----
    Costs: the device keeps its data, one autoencoder per local cluster
    (174,840 float32 parameters, 0.7 MB, for 784-100-64-32) and every
    received cluster model it has not replaced yet (all-to-all exchange:
    about ``sum_j K_j`` models), plus per-sample errors of each (8 bytes per
    sample and model). Per iteration, an active device trains ``K_i``
    autoencoders for ``epochs`` epochs, runs every new received model once
    over its samples, trains ``community_epochs`` per community round for the
    communities it belongs to and refines with one pass of the community
    models. A stable device only evaluates new models and trains in its
    communities.
    """

    def __init__(
        self,
        cid: str,
        x: Any,
        *,
        n_clusters: Optional[int] = None,
        k_range: Sequence[int] = (2, 5),
        init: str = "kmeans",
        encoder: Any = "auto",
        latents: Any = None,
        true_labels: Any = None,
        initial_labels: Any = None,
        dirtiness: float = 0.3,
        architecture: Optional[str] = None,
        epochs: int = 20,
        lr: float = 1e-3,
        batch_size: int = 32,
        community_epochs: int = 1,
        alpha: float = 75.0,
        normalization: str = "relative",
        link_communities: bool = True,
        warm_start: bool = False,
        init_seed: int = 0,
        seed: int = 0,
        threads: Optional[int] = None,
    ) -> None:
        if not isinstance(cid, str) or not cid or any(c in cid for c in "/+#: "):
            raise ValueError(f"cid must be a non-empty id without '/', '+', '#', ':' or spaces, got {cid!r}")
        self.cid = cid
        arr = np.asarray(x)
        if not np.issubdtype(arr.dtype, np.floating) or arr.ndim < 2 or arr.shape[0] < 2:
            raise ValueError(
                f"x must be a floating-point array of at least 2 samples, shape (n, ...), got "
                f"dtype {arr.dtype} and shape {arr.shape}"
            )
        self.x = np.ascontiguousarray(arr.reshape(arr.shape[0], -1), dtype=np.float32)
        if not np.isfinite(self.x).all() or self.x.min() < -1e-6 or self.x.max() > 1 + 1e-6:
            raise ValueError("x must hold finite values in [0, 1]")
        if init not in INIT_METHODS:
            raise ValueError(f"init must be one of {INIT_METHODS}, got {init!r}")
        self.init = init
        self.n_clusters = None if n_clusters is None else check_int(n_clusters, "n_clusters")
        self.k_range = _check_k_range(k_range)
        self.encoder = encoder
        self.latents = latents
        self.true_labels = true_labels
        self.initial_labels = initial_labels
        if not _is_number(dirtiness) or not 0.0 <= float(dirtiness) <= 0.5:
            raise ValueError(f"dirtiness must be a probability in [0, 0.5], got {dirtiness!r}")
        self.dirtiness = float(dirtiness)
        self.architecture = architecture_for(self.x.shape[1]) if architecture is None else architecture
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
        if ARCHITECTURES[self.architecture][0] != self.x.shape[1]:
            raise ValueError(
                f"architecture {self.architecture!r} takes {ARCHITECTURES[self.architecture][0]} features, "
                f"x has {self.x.shape[1]}"
            )
        self.epochs = check_int(epochs, "epochs")
        self.lr = check_positive(lr, "lr")
        self.batch_size = check_int(batch_size, "batch_size")
        self.community_epochs = check_int(community_epochs, "community_epochs")
        self.alpha = check_alpha(alpha)
        self.normalization = check_normalization(normalization)
        self.link_communities = bool(link_communities)
        self.warm_start = bool(warm_start)
        self.init_seed = int(init_seed)
        self.seed = int(seed)
        self.threads = None if threads is None else check_int(threads, "threads")

        self.labels_: Optional[np.ndarray] = None
        self.initial_labels_: Optional[np.ndarray] = None
        self.n_clusters_ = 0
        self.latents_: Optional[np.ndarray] = None
        self.silhouette_: dict[int, float] = {}
        self.models_: dict[int, dict[str, np.ndarray]] = {}
        self.stability_: Optional[float] = None
        self.train_seconds_ = 0.0
        self.eval_seconds_ = 0.0
        self._own_versions: dict[int, str] = {}  # cluster -> id of the model now representing it
        self._published: Optional[tuple[str, ...]] = None
        self._defining: dict[int, dict[str, np.ndarray]] = {}  # cluster -> model that defined it (warm start)
        self._ext: dict[str, tuple[str, dict[str, np.ndarray]]] = {}  # node -> (version, weights)
        self._err: dict[str, tuple[str, np.ndarray]] = {}  # model id -> (version, errors on all samples)
        self._counter = 0

    # ------------------------------------------------------------------ helpers

    def _check_ready(self) -> np.ndarray:
        if self.labels_ is None:
            raise RuntimeError(f"client {self.cid}: call initialize() first")
        return self.labels_

    def _errors(self, model_id: str, version: str, weights: Mapping[str, np.ndarray]) -> np.ndarray:
        """Errors of a model on all local samples, cached by (model id, version)."""
        hit = self._err.get(model_id)
        if hit is not None and hit[0] == version:
            return hit[1]
        t0 = time.perf_counter()
        torch = _import_torch()
        with _threads(torch, self.threads):
            e = reconstruction_errors(self.architecture, weights, self.x)
        self.eval_seconds_ += time.perf_counter() - t0
        self._err[model_id] = (version, e)
        return e

    def _new_version(self) -> str:
        self._counter += 1
        return f"{self.cid}.{self._counter}"

    def _set_labels(self, labels: np.ndarray) -> None:
        _, compact = np.unique(labels, return_inverse=True)
        self.labels_ = compact.astype(np.int64)
        self.n_clusters_ = int(self.labels_.max()) + 1

    # ------------------------------------------------------------------ phase 0: initial clustering

    def _latent_codes(self) -> np.ndarray:
        if self.latents is not None:
            z = np.asarray(self.latents, dtype=np.float64)
            if z.ndim != 2 or z.shape[0] != self.x.shape[0]:
                raise ValueError(f"latents must have shape ({self.x.shape[0]}, d), got {z.shape}")
            return z
        enc = self.encoder
        if isinstance(enc, str):
            name = DEFAULT_ENCODERS.get(self.x.shape[1]) if enc == "auto" else enc
            if name is None:
                return self.x.astype(np.float64)
            from .encoder import OnnxEncoder

            enc = OnnxEncoder(name, threads=1)
        if enc is None:
            return self.x.astype(np.float64)
        shape = getattr(enc, "input_shape", None)
        x = self.x if shape is None else self.x.reshape((self.x.shape[0],) + tuple(shape))
        return np.asarray(enc.encode(x), dtype=np.float64)

    def initialize(self) -> Payload:
        """Initial local clustering; returns the hello object ``(meta, {})``.

        Returns
        -------
        (dict, dict)
            ``meta`` = ``{"type": "hello", "cid", "n_samples", "n_features",
            "n_clusters", "architecture", "init"}``, no tensors.
        """
        if self.init == "kmeans":
            z = self._latent_codes()
            self.latents_ = z.astype(np.float32)
            if self.n_clusters is None:
                _, labels, self.silhouette_ = estimate_n_clusters(z, self.k_range, seed=self.seed)
            else:
                if self.n_clusters > self.x.shape[0]:
                    raise ValueError(f"n_clusters ({self.n_clusters}) exceeds the {self.x.shape[0]} samples")
                from sklearn.cluster import KMeans

                labels = KMeans(n_clusters=self.n_clusters, n_init=10, random_state=self.seed).fit_predict(z)
        elif self.init == "dirty":
            if self.true_labels is None:
                raise ValueError("init='dirty' needs true_labels (it simulates a noisy clustering of them)")
            y = np.asarray(self.true_labels).ravel()
            if y.shape[0] != self.x.shape[0]:
                raise ValueError(f"true_labels has {y.shape[0]} entries for {self.x.shape[0]} samples")
            labels = dirty_labels(y, self.dirtiness, seed=self.seed)
        else:
            if self.initial_labels is None:
                raise ValueError("init='given' needs initial_labels")
            labels = np.asarray(self.initial_labels).ravel()
            if labels.shape[0] != self.x.shape[0] or not np.issubdtype(labels.dtype, np.integer):
                raise ValueError(f"initial_labels must be {self.x.shape[0]} integers, got {labels.dtype} {labels.shape}")
        self._set_labels(np.asarray(labels))
        self.initial_labels_ = self.labels_.copy()
        self.models_ = {}
        self._own_versions = {}
        self._published = None
        log.info("client %s: %d samples in %d initial clusters (%s)", self.cid, self.x.shape[0],
                 self.n_clusters_, self.init)
        meta = {"type": "hello", "cid": self.cid, "n_samples": int(self.x.shape[0]),
                "n_features": int(self.x.shape[1]), "n_clusters": self.n_clusters_,
                "architecture": self.architecture, "init": self.init}
        return meta, {}

    # ------------------------------------------------------------------ phase 1: cluster models

    def train_models(self, command: Mapping[str, Any]) -> Optional[Payload]:
        """Train one autoencoder per local cluster (when told to) and publish changed models.

        Parameters
        ----------
        command : mapping
            ``{"iteration": t, "train": bool}``; ``train`` is true for an
            active client (and always before the first models exist).

        Returns
        -------
        (dict, dict) or None
            ``meta`` = ``{"type": "cluster_models", "cid", "iteration",
            "architecture", "clusters": [{"q", "n", "version"}, ...]}`` and
            the models as ``{"<q>/<param>": array}``; None when nothing
            changed since the last publication.
        """
        labels = self._check_ready()
        it = int(command.get("iteration", 0))
        train = bool(command.get("train", True)) or not self.models_
        if train:
            torch = _import_torch()
            t0 = time.perf_counter()
            base = initial_ae_weights(self.architecture, self.init_seed)
            models: dict[int, dict[str, np.ndarray]] = {}
            with _threads(torch, self.threads):
                for q in range(self.n_clusters_):
                    members = self.x[labels == q]
                    start = self._defining.get(q, base) if self.warm_start else base
                    models[q], _ = train_cluster_ae(
                        self.architecture, start, members, epochs=self.epochs, lr=self.lr,
                        batch_size=self.batch_size, seed=self.seed * 7919 + it * 131 + q,
                    )
            self.train_seconds_ += time.perf_counter() - t0
            self.models_ = models
            self._own_versions = {q: self._new_version() for q in models}
        versions = tuple(self._own_versions[q] for q in sorted(self.models_))
        if versions == self._published:
            return None
        self._published = versions
        counts = np.bincount(labels, minlength=self.n_clusters_)
        meta = {
            "type": "cluster_models",
            "cid": self.cid,
            "iteration": it,
            "architecture": self.architecture,
            "clusters": [{"q": int(q), "n": int(counts[q]), "version": self._own_versions[q]}
                         for q in sorted(self.models_)],
        }
        return meta, join_models({str(q): w for q, w in sorted(self.models_.items())})

    def receive_models(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        """Store another client's cluster models (the relay of its ``cluster_models`` object).

        The owner's previous models are forgotten: its ``clusters`` list is
        its complete current set.
        """
        owner = str(meta["cid"])
        if owner == self.cid:
            return
        if meta.get("architecture") != self.architecture:
            raise ValueError(
                f"client {self.cid}: models of {owner} are {meta.get('architecture')!r}, "
                f"this client uses {self.architecture!r}"
            )
        models = split_models(tensors)
        for key in [k for k in self._ext if k.rsplit(":", 1)[0] == owner]:
            del self._ext[key]
            self._err.pop(key, None)
        for c in meta["clusters"]:
            q = int(c["q"])
            if str(q) not in models:
                raise ValueError(f"client {self.cid}: the models of {owner} lack cluster {q}")
            self._ext[node_key(owner, q)] = (str(c["version"]), models[str(q)])

    # ------------------------------------------------------------------ phase 2: association test

    def association_report(self, command: Mapping[str, Any] | None = None) -> Payload:
        """This client's side of the association test, against every model it holds.

        Returns
        -------
        (dict, dict)
            ``meta`` = ``{"type": "association", "cid", "iteration",
            "clusters": [node ids], "external": [node ids], "alpha"}`` and
            ``{"stat": float32 (K_i, n_external)}``: entry ``[q, j]`` is
            :func:`association_statistic` of own cluster ``q`` against external
            cluster ``j`` (an empty cluster gives 1.0, never associating).
        """
        labels = self._check_ready()
        it = int((command or {}).get("iteration", 0))
        own = sorted(self.models_)
        ext = sorted(self._ext)
        stat = np.ones((len(own), len(ext)), dtype=np.float32)
        own_err = {q: self._errors(f"own:{q}", self._own_versions[q], self.models_[q]) for q in own}
        for j, key in enumerate(ext):
            version, weights = self._ext[key]
            e_ext = self._errors(key, version, weights)
            for i, q in enumerate(own):
                mask = labels == q
                if mask.any():
                    stat[i, j] = association_statistic(own_err[q][mask], e_ext[mask], self.alpha,
                                                       self.normalization)
        meta = {"type": "association", "cid": self.cid, "iteration": it,
                "clusters": [node_key(self.cid, q) for q in own], "external": ext, "alpha": self.alpha,
                "normalization": self.normalization}
        return meta, {"stat": stat}

    # ------------------------------------------------------------------ phase 3: community FedAvg

    def community_update(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Payload:
        """Train a community model on the member clusters' samples (one FedAvg round).

        Parameters
        ----------
        meta : mapping
            ``{"type": "community_model", "community": g, "round": r,
            "iteration": t, "members": [node ids of this client]}``.
        tensors : mapping
            The community model.

        Returns
        -------
        (dict, dict)
            ``meta`` = ``{"type": "community_update", "cid", "community",
            "round", "n"}`` and the trained weights.
        """
        labels = self._check_ready()
        g = int(meta["community"])
        rnd = int(meta.get("round", 0))
        it = int(meta.get("iteration", 0))
        qs = []
        for key in meta["members"]:
            owner, _, q = str(key).rpartition(":")
            if owner != self.cid:
                raise ValueError(f"client {self.cid} got community {g} training for {key}")
            qs.append(int(q))
        mask = np.isin(labels, qs)
        if not mask.any():
            raise ValueError(f"client {self.cid}: member clusters {qs} of community {g} are empty")
        torch = _import_torch()
        t0 = time.perf_counter()
        with _threads(torch, self.threads):
            weights, _ = train_cluster_ae(
                self.architecture, tensors, self.x[mask], epochs=self.community_epochs, lr=self.lr,
                batch_size=self.batch_size, seed=self.seed * 7919 + it * 131 + g * 17 + rnd + 1_000_003,
            )
        self.train_seconds_ += time.perf_counter() - t0
        out = {"type": "community_update", "cid": self.cid, "community": g, "round": rnd, "n": int(mask.sum())}
        return out, weights

    # ------------------------------------------------------------------ phase 4: refinement

    def refine(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Payload:
        """Algorithm 2 over the own models and the received community models.

        Each own model and each community model is a candidate of
        :func:`refine_labels`. With ``link_communities`` (the default) an own
        cluster's model and the models of the communities that cluster belongs
        to form a single candidate (per-sample error: the lowest of theirs):
        they describe the same category, and as separate candidates they
        split its samples between two new clusters while another category's
        samples are left to the final assignment.

        Parameters
        ----------
        meta : mapping
            ``{"type": "community_models", "iteration": t, "communities":
            [g, ...], "versions": [...], "members": {"<g>": [node ids]}}``.
        tensors : mapping
            The community models as ``{"<g>/<param>": array}`` (may be empty).

        Returns
        -------
        (dict, dict)
            ``meta`` = ``{"type": "refined", "cid", "iteration",
            "stability", "n_clusters", "selected": [...]}``, no tensors.
            ``stability`` is the Hungarian-matched agreement of the labels
            before and after; ``selected[p]`` describes the model now
            representing new cluster ``p`` (``{"kind": "local", "q"}`` or
            ``{"kind": "community", "g"}``) and ``"community"``, the community
            its candidate stands for (-1 for none).
        """
        labels = self._check_ready()
        it = int(meta.get("iteration", 0))
        comm = split_models(tensors) if tensors else {}
        gs = [int(g) for g in meta.get("communities", [])]
        versions = [str(v) for v in meta.get("versions", [f"{it}.{g}" for g in gs])]
        own = sorted(self.models_)
        columns: list[tuple[str, int]] = [("local", q) for q in own] + [("community", g) for g in gs]
        errs = [self._errors(f"own:{q}", self._own_versions[q], self.models_[q]) for q in own]
        for g, v in zip(gs, versions):
            if str(g) not in comm:
                raise ValueError(f"client {self.cid}: community model {g} is missing")
            errs.append(self._errors(f"community:{g}", f"community:{v}", comm[str(g)]))
        err = np.stack(errs, axis=1)
        groups = self._candidate_groups(own, gs, meta.get("members", {}) if self.link_communities else {})
        cand = np.stack([err[:, grp].min(axis=1) for grp in groups], axis=1)
        k = min(self.n_clusters_, len(groups))
        new, selected = refine_labels(cand, k)
        self.stability_ = hungarian_accuracy(labels, new)
        models: dict[int, dict[str, np.ndarray]] = {}
        own_versions: dict[int, str] = {}
        described = []
        for q in own:
            self._err.pop(f"own:{q}", None)
        for p, c in enumerate(selected):
            grp = groups[c]
            members = new == p
            col = grp[int(np.argmin(err[np.ix_(members, grp)].mean(axis=0)))] if members.any() else grp[0]
            kind, ident = columns[col]
            linked = [columns[j][1] for j in grp if columns[j][0] == "community"]
            if kind == "local":
                models[p] = self.models_[ident]
                own_versions[p] = self._own_versions[ident]
                described.append({"kind": "local", "q": int(ident), "community": min(linked, default=-1)})
            else:
                models[p] = comm[str(ident)]
                own_versions[p] = self._new_version()
                described.append({"kind": "community", "g": int(ident), "community": int(ident)})
            # the model's errors on the local samples are known: keep them under the new index
            self._err[f"own:{p}"] = (own_versions[p], err[:, col])
        self.models_ = models
        self._own_versions = own_versions
        self._defining = dict(models)
        if len(selected) < self.n_clusters_:
            log.info("client %s: refinement formed %d of %d clusters", self.cid, len(selected), self.n_clusters_)
        self._set_labels(new)
        out = {"type": "refined", "cid": self.cid, "iteration": it, "stability": float(self.stability_),
               "n_clusters": self.n_clusters_, "selected": described}
        return out, {}

    def _candidate_groups(self, own: Sequence[int], gs: Sequence[int],
                          members: Mapping[str, Sequence[str]]) -> list[list[int]]:
        """Columns of the error matrix grouped into candidates (own clusters linked to their communities)."""
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
                if owner == self.cid and int(q) in pos:
                    a, b = find(pos[int(q)]), find(n_own + j)
                    if a != b:
                        parent[max(a, b)] = min(a, b)
        groups: dict[int, list[int]] = {}
        for i in range(n_own + len(gs)):
            groups.setdefault(find(i), []).append(i)
        return [groups[r] for r in sorted(groups)]


# --------------------------------------------------------------------------- ONNX Runtime labeller


class OnnxCommunityLabeler:
    """Label new samples with exported community autoencoders, ONNX Runtime only.

    Each sample goes to the community whose autoencoder reconstructs it with
    the lowest mean squared error (the rule of FedCRef's refinement).

    Parameters
    ----------
    models : sequence of path, or a folder
        The community ``.onnx`` files (input ``x`` ``(batch, d)``, output
        the reconstruction), in community order; or the folder written by
        :func:`server_kit.fedcref.export_communities`, whose
        ``communities.json`` lists them (their sha256 is checked).
    batch_size : int
        Samples per ONNX Runtime call.
    threads : int, optional
        Intra-op threads of each session.

    Attributes
    ----------
    communities : list of int
        Community id of each model, in column order of :meth:`errors`.
    """

    def __init__(self, models: Any, *, batch_size: int = 1024, threads: Optional[int] = None) -> None:
        import json

        import onnxruntime as ort

        from .artifacts import sha256_file

        self.batch_size = check_int(batch_size, "batch_size")
        paths: list[Path]
        if isinstance(models, (str, os.PathLike)) and Path(models).is_dir():
            folder = Path(models)
            index = json.loads((folder / "communities.json").read_text())
            paths, self.communities = [], []
            for entry in index["communities"]:
                path = folder / entry["file"]
                if sha256_file(path) != entry["sha256"]:
                    raise ValueError(f"{path} does not match the sha256 recorded in communities.json")
                paths.append(path)
                self.communities.append(int(entry["community"]))
        else:
            paths = [Path(p) for p in models]
            self.communities = list(range(len(paths)))
        if not paths:
            raise ValueError("no community models to label with")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads is not None:
            opts.intra_op_num_threads = check_int(threads, "threads")
            opts.inter_op_num_threads = 1
        self._sessions = [ort.InferenceSession(str(p), sess_options=opts, providers=["CPUExecutionProvider"])
                          for p in paths]
        dims = {s.get_inputs()[0].shape[-1] for s in self._sessions}
        if len(dims) != 1 or not isinstance(next(iter(dims)), int):
            raise ValueError(f"community models disagree on their input size: {sorted(map(str, dims))}")
        self.n_features = int(next(iter(dims)))

    def errors(self, x: Any) -> np.ndarray:
        """Per-sample mean squared reconstruction error of every model, ``(n, n_models)`` float64."""
        xa = _as_inputs(x, self.n_features)
        if not np.isfinite(xa).all():
            raise ValueError("x contains NaN or Inf")
        out = np.empty((xa.shape[0], len(self._sessions)), dtype=np.float64)
        for j, sess in enumerate(self._sessions):
            name = sess.get_inputs()[0].name
            for start in range(0, xa.shape[0], self.batch_size):
                xb = xa[start : start + self.batch_size]
                rec = sess.run(None, {name: xb})[0].reshape(xb.shape[0], -1)
                out[start : start + xb.shape[0], j] = np.mean((rec.astype(np.float64) - xb) ** 2, axis=1)
        return out

    def predict(self, x: Any) -> np.ndarray:
        """Community id of each sample (lowest reconstruction error)."""
        return np.asarray(self.communities, dtype=np.int64)[np.argmin(self.errors(x), axis=1)]
