"""FLIS (Morafah et al.): clustered FL by the inference similarity of the clients' models.

The server holds a small labelled **auxiliary set** of its own (the paper:
2,500 test images, 250 per class, that no client holds). It runs every
client's trained model on that set, server-side, and reduces the update at
once to its predictions ``B_k`` (``m x C``: ``m`` auxiliary samples, ``C``
classes). Two clients are alike when their models answer alike:

    ``A_ij = <B_i, B_j>_F / (||B_i||_F ||B_j||_F)``

in ``[0, 1]``. With one-hot predictions (``predictions="hard"``, the authors'
code) ``A_ij`` is the fraction of auxiliary samples on which the two models
predict the same class; with ``predictions="soft"`` ``B`` holds softmax
probabilities (``temperature`` scales the logits first). The paper prints the
numerator as ``||B_i (.) B_j||_F``, the norm of the Hadamard product; its
released code sums the product instead (``(A1 * A2).sum()``), which is what
makes ``A`` an agreement rate in ``[0, 1]`` (the printed form would give
``sqrt(agreements) / m``): that is what is computed here.

Two variants:

* :class:`FLISHC` (Algorithm 3): every client trains the initial model once
  (round ``cluster_round``), the server clusters the distances ``1 - A``
  hierarchically (``linkage``, default complete, cut at
  ``distance_threshold``), every cluster restarts from the initial model
  (``cluster_init="initial"``, as the paper) and trains by FedAvg per cluster.
  Disjoint clusters, fixed after that round.
* :class:`FLISDC` (Algorithms 1 and 2): clusters are re-formed every round.
  Each sampled client is offered all cluster models of the previous round,
  trains the one with the lowest loss on a local batch (as IFCA), and the
  server thresholds the round's similarities: client ``i``'s cluster is
  ``C_i = {j : A_ij >= threshold}``; each distinct ``C_i`` becomes one cluster
  model, the FedAvg of its members' updates. Clusters may overlap (a client
  can be in several ``C_i``); ``threshold=0`` is FedAvg, ``threshold=1``
  almost local training.

The pure math (:func:`softmax`, :func:`prediction_matrix`,
:func:`inference_similarity`, :func:`threshold_clusters`,
:func:`distinct_clusters`, :func:`hierarchical_labels`) is outside the
classes. Inference runs with torch when installed, else with ONNX Runtime on
the architecture's shipped classifier template (:mod:`edge_sdk.trainer`).
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk._validation import check_int, check_number
from edge_sdk.worker import Task, Update

from ..clustering.hierarchy import cut_tree
from ..strategy import ClientInfo, ClusteredFedAvg, Strategy, Weights, copy_weights
from .update_clustered import UpdateClustered, finite_update

__all__ = [
    "CLUSTER_INITS",
    "FLISDC",
    "FLISHC",
    "INFERENCE",
    "LINKAGES",
    "PREDICTIONS",
    "aux_logits",
    "check_aux",
    "cross_similarity",
    "distinct_clusters",
    "hierarchical_labels",
    "inference_similarity",
    "load_aux",
    "prediction_matrix",
    "softmax",
    "threshold_clusters",
]

log = logging.getLogger(__name__)

#: Runtimes for the server-side inference.
INFERENCE: tuple[str, ...] = ("auto", "torch", "onnx")
#: What ``B_k`` holds: one-hot predicted classes or softmax probabilities.
PREDICTIONS: tuple[str, ...] = ("hard", "soft")
#: Linkages of :class:`FLISHC` (scipy's names; the authors' code calls complete "maximum").
LINKAGES: tuple[str, ...] = ("complete", "average", "single")
#: Where FLIS-HC's clusters start: the initial model (paper) or the global model after the round.
CLUSTER_INITS: tuple[str, ...] = ("initial", "global")

#: Auxiliary samples per forward pass.
_BATCH = 256
_PREFIX = "_flis/"


# --------------------------------------------------------------------------- pure math


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise ``softmax(logits / temperature)`` in float64 (max-subtracted, so no overflow)."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def prediction_matrix(probabilities: np.ndarray, kind: str = "hard") -> np.ndarray:
    """``B``: one-hot of the argmax (``"hard"``) or the probabilities themselves (``"soft"``).

    ``probabilities`` is ``(..., m, C)``; ties in the argmax go to the lower class.
    """
    p = np.asarray(probabilities, dtype=np.float64)
    if kind == "soft":
        return p
    if kind != "hard":
        raise ValueError(f"kind must be one of {PREDICTIONS}, got {kind!r}")
    return np.eye(p.shape[-1], dtype=np.float64)[np.argmax(p, axis=-1)]


def cross_similarity(b1: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """``(n1, n2)`` normalised Frobenius products of two stacks of ``(m, C)`` matrices.

    An all-zero matrix (which neither kind of prediction produces) is at
    similarity 0 from everything.
    """
    f1 = np.asarray(b1, dtype=np.float64).reshape(len(b1), -1)
    f2 = np.asarray(b2, dtype=np.float64).reshape(len(b2), -1)
    if f1.shape[1] != f2.shape[1]:
        raise ValueError(f"prediction matrices differ in size: {f1.shape[1]} vs {f2.shape[1]} values")
    n1, n2 = np.linalg.norm(f1, axis=1), np.linalg.norm(f2, axis=1)
    s = f1 @ f2.T
    s /= np.where(n1 > 0, n1, 1.0)[:, None]
    s /= np.where(n2 > 0, n2, 1.0)[None, :]
    return np.clip(s, 0.0, 1.0)


def inference_similarity(b: np.ndarray) -> np.ndarray:
    """FLIS's adjacency ``A_ij = <B_i, B_j>_F / (||B_i||_F ||B_j||_F)`` of ``(n, m, C)`` predictions.

    Symmetric, in ``[0, 1]`` for non-negative ``B``, with a unit diagonal
    (for non-zero ``B``). For one-hot ``B`` it is the agreement rate of the
    predicted classes.
    """
    a = np.asarray(b)
    if a.ndim != 3:
        raise ValueError(f"predictions must be a (clients, samples, classes) array, got shape {a.shape}")
    s = cross_similarity(a, a)
    s = (s + s.T) / 2.0
    norms = np.linalg.norm(a.reshape(len(a), -1), axis=1)
    np.fill_diagonal(s, np.where(norms > 0, 1.0, 0.0))
    return s


def threshold_clusters(similarity: np.ndarray, threshold: float) -> list[tuple[int, ...]]:
    """FLIS-DC's hard thresholding: for each client ``i``, ``C_i = {j : A_ij >= threshold}``.

    ``i`` is always in its own ``C_i``. Returns the sorted members of each
    ``C_i``, in the order of the rows; clusters may overlap.
    """
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"similarity must be a square matrix, got shape {s.shape}")
    out = []
    for i in range(s.shape[0]):
        members = set(np.flatnonzero(s[i] >= threshold).tolist()) | {i}
        out.append(tuple(sorted(members)))
    return out


def distinct_clusters(sets: Sequence[Sequence[int]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Label of each row's set among the distinct sets (numbered by first appearance), and those sets."""
    index: dict[tuple[int, ...], int] = {}
    labels = []
    for s in sets:
        key = tuple(sorted(int(j) for j in s))
        labels.append(index.setdefault(key, len(index)))
    return labels, list(index)


def hierarchical_labels(similarity: np.ndarray, distance_threshold: float, linkage: str = "complete") -> np.ndarray:
    """Agglomerative clusters of the distances ``1 - A`` cut at ``distance_threshold``.

    Two clusters merge while their ``linkage`` distance (complete: the
    largest pairwise distance; average; single: the smallest) is at most the
    threshold. Labels are 0-based, numbered by first appearance.
    """
    if linkage not in LINKAGES:
        raise ValueError(f"linkage must be one of {LINKAGES}, got {linkage!r}")
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"similarity must be a square matrix, got shape {s.shape}")
    d = np.clip(1.0 - (s + s.T) / 2.0, 0.0, 1.0)
    np.fill_diagonal(d, 0.0)
    raw, _ = cut_tree(d, distance_threshold, linkage)
    order = {lab: k for k, lab in enumerate(dict.fromkeys(raw.tolist()))}
    return np.array([order[lab] for lab in raw.tolist()], dtype=np.int64)


# --------------------------------------------------------------------------- the auxiliary set


def load_aux(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Arrays ``x`` and ``y`` of an ``.npz`` file, read without pickle.

    Raises
    ------
    FileNotFoundError
        If there is no such file.
    ValueError
        If the file is not an ``.npz`` archive of plain arrays holding ``x`` and ``y``.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"aux_path {p!r}: no such file")
    try:
        with np.load(p, allow_pickle=False) as f:
            if not hasattr(f, "files"):
                raise ValueError(f"aux_path {p!r} is a single .npy array; expected an .npz archive with x and y")
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise ValueError(f"aux_path {p!r} lacks array(s) {missing}; it holds {sorted(f.files)}")
            return np.array(f["x"]), np.array(f["y"])
    except ValueError as e:
        if "pickle" in str(e):
            raise ValueError(f"aux_path {p!r} holds pickled or object data, which is refused; "
                             "save plain numeric arrays with numpy.savez") from e
        raise
    except (zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"aux_path {p!r} is not a readable .npz archive: {e}") from e


def check_aux(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    """The auxiliary samples as float32 and labels as int64, or a ValueError saying what is wrong."""
    xa, ya = np.asarray(x), np.asarray(y)
    if xa.dtype == object or ya.dtype == object:
        raise ValueError("aux_x and aux_y must be numeric arrays, not object arrays")
    if not np.issubdtype(xa.dtype, np.floating):
        raise ValueError(f"aux_x must be a floating-point array (images in [0, 1]), got dtype {xa.dtype}")
    if xa.ndim < 2 or xa.shape[0] < 1:
        raise ValueError(f"aux_x must be (n, ...) with at least one sample, got shape {xa.shape}")
    if not np.isfinite(xa).all():
        raise ValueError("aux_x contains NaN or Inf")
    if ya.ndim != 1 or ya.shape[0] != xa.shape[0]:
        raise ValueError(f"aux_y must be 1-D with one label per sample of aux_x ({xa.shape[0]}), got shape {ya.shape}")
    if not np.issubdtype(ya.dtype, np.integer):
        raise ValueError(f"aux_y must hold integer class labels, got dtype {ya.dtype}")
    if ya.min() < 0:
        raise ValueError(f"aux_y must hold non-negative class labels, got {int(ya.min())}")
    return np.ascontiguousarray(xa, dtype=np.float32), ya.astype(np.int64)


def aux_logits(architecture: str, weights: Weights, x: np.ndarray, y: np.ndarray, *, runtime: str,
               models_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """``(m, C)`` logits of ``weights`` on the auxiliary samples, with torch or ONNX Runtime.

    Uses the evaluation paths of :mod:`edge_sdk.trainer`, which check the
    weights against the architecture and the samples against its input.
    """
    from edge_sdk import trainer

    if runtime == "torch":
        logits, _ = trainer._torch_logits(architecture, weights, x, y, _BATCH, "cpu", None)
    elif runtime == "onnx":
        logits, _ = trainer._onnx_logits(architecture, weights, x, y, _BATCH, models_dir, None)
    else:
        raise ValueError(f"runtime must be 'torch' or 'onnx', got {runtime!r}")
    return np.asarray(logits, dtype=np.float64)


# --------------------------------------------------------------------------- shared part


class _AuxInference:
    """The server's auxiliary set and the reduction of a model to its predictions on it."""

    def __init__(self, *, architecture: str | None = None, aux_path: str | os.PathLike[str] | None = None,
                 aux_x: np.ndarray | None = None, aux_y: np.ndarray | None = None, inference: str = "auto",
                 predictions: str = "hard", temperature: float = 1.0,
                 models_dir: str | os.PathLike[str] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        if not architecture or not isinstance(architecture, str):
            raise ValueError(f"{self.name} runs the clients' models on the server's auxiliary set: give "
                             f"architecture (a classifier key of edge_sdk.nets), got {architecture!r}")
        if inference not in INFERENCE:
            raise ValueError(f"inference must be one of {INFERENCE}, got {inference!r}")
        if predictions not in PREDICTIONS:
            raise ValueError(f"predictions must be one of {PREDICTIONS}, got {predictions!r}")
        from edge_sdk.trainer import torch_available

        if inference == "torch" and not torch_available():
            raise ValueError("inference='torch' needs torch, which is not installed; use 'onnx' or 'auto'")
        if aux_path is not None and (aux_x is not None or aux_y is not None):
            raise ValueError("give either aux_path or aux_x and aux_y, not both")
        if aux_path is None and (aux_x is None or aux_y is None):
            raise ValueError(f"{self.name} needs the server's labelled auxiliary set: give aux_path (an .npz "
                             "with arrays x and y) or both aux_x and aux_y")
        x, y = load_aux(aux_path) if aux_path is not None else (aux_x, aux_y)
        self.architecture = architecture
        self.aux_path = None if aux_path is None else os.fspath(aux_path)
        self.inference = inference
        self.predictions = predictions
        self.temperature = check_number(temperature, "temperature", low=0.0, low_open=True)
        self.models_dir = None if models_dir is None else os.fspath(models_dir)
        self.aux_x_, self.aux_y_ = check_aux(x, y)
        #: The runtime actually used ("torch" or "onnx").
        self.runtime_ = "torch" if inference == "torch" or (inference == "auto" and torch_available()) else "onnx"
        #: Accuracy on the auxiliary set of the latest model seen from each client (for the logs).
        self.aux_accuracy_: dict[str, float] = {}

    def setup(self, clients: Sequence[ClientInfo], template: Weights) -> None:
        """As the base; also runs the template on the auxiliary set once, so a misfit fails here."""
        super().setup(clients, template)  # type: ignore[misc]
        try:
            self.aux_predictions(template)
        except ValueError as e:
            raise ValueError(f"{self.name}: the auxiliary set does not fit architecture "
                             f"{self.architecture!r}: {e}") from e

    def aux_predictions(self, weights: Weights, cid: str | None = None) -> np.ndarray:
        """``(m, C)`` float32 softmax probabilities of ``weights`` on the auxiliary set."""
        z = aux_logits(self.architecture, weights, self.aux_x_, self.aux_y_, runtime=self.runtime_,
                       models_dir=self.models_dir)
        if cid is not None:
            self.aux_accuracy_[cid] = float(np.mean(np.argmax(z, axis=1) == self.aux_y_))
        return softmax(z, self.temperature).astype(np.float32)

    def _reduce(self, rnd: int, updates: Sequence[Update]) -> list[tuple[Update, np.ndarray]]:
        """Each update with its predictions; an update whose inference fails is logged and left out."""
        out = []
        for u in updates:
            try:
                out.append((u, self.aux_predictions(u.weights, u.cid)))
            except ValueError as e:
                log.warning("%s round %d: update of %s not used for clustering: %s", self.name, rnd, u.cid, e)
        return out

    def _similarity(self, probs: Sequence[np.ndarray]) -> np.ndarray:
        return inference_similarity(np.stack([prediction_matrix(p, self.predictions) for p in probs]))


def _log_similarity(name: str, rnd: int, s: np.ndarray, labels: Sequence[int]) -> None:
    lab = np.asarray(labels)
    same = np.equal.outer(lab, lab) & ~np.eye(len(lab), dtype=bool)
    within = float(s[same].min()) if same.any() else float("nan")
    between = float(s[~np.equal.outer(lab, lab)].max()) if len(set(lab.tolist())) > 1 else float("nan")
    log.info("%s round %d: inference similarity within clusters >= %.3f, between <= %.3f", name, rnd, within,
             between)


# --------------------------------------------------------------------------- FLIS-HC


class FLISHC(_AuxInference, UpdateClustered):
    """FLIS (HC): cluster once, hierarchically, by the inference similarity of the first models.

    Parameters
    ----------
    architecture : str
        Classifier key of :data:`edge_sdk.nets.ARCHITECTURES` the clients train
        (:func:`~server_kit.strategy.make_strategy` passes the driver's).
    aux_path : str, optional
        An ``.npz`` file with arrays ``x`` (float samples in the model's input
        or image shape, in [0, 1]) and ``y`` (int labels): the server's
        auxiliary set, from data the clients do not hold. Read with
        ``allow_pickle=False``.
    aux_x, aux_y : numpy.ndarray, optional
        The same as arrays (instead of ``aux_path``).
    distance_threshold : float
        Cut of the dendrogram of ``1 - A``, in [0, 1]: clusters merge while
        their linkage distance is at most this. Default 0.55, the distance of
        the authors' similarity threshold 0.45 for HC.
    linkage : {"complete", "average", "single"}
        Complete is the authors' default ("maximum").
    cluster_round : int
        The round whose updates are clustered (1: the first, as Algorithm 3;
        later rounds warm up by FedAvg first). At most ``max_warmup_rounds``.
    cluster_init : {"initial", "global"}
        Where the clusters start: the initial model (paper, Algorithm 3 line 7)
        or the global model as it stands after the clustering round.
    inference : {"auto", "torch", "onnx"}
        Runtime of the server's inference (auto: torch when installed).
    predictions : {"hard", "soft"}
        ``B`` as one-hot predicted classes (the authors' code) or softmax
        probabilities.
    temperature : float
        Softmax temperature (> 0) of the soft predictions.
    models_dir : str, optional
        Manifest folder of the ONNX classifier templates (ONNX runtime only).
    max_warmup_rounds, warmup_fraction, shared_prefixes, settings, fraction, seed
        As for :class:`~server_kit.strategies.update_clustered.UpdateClustered`.

    Attributes
    ----------
    similarity_ : numpy.ndarray or None
        ``(n, n)`` inference similarity of the clustered clients.
    similarity_cids_ : list of str
        Their ids, in the rows' order.
    aux_accuracy_ : dict of str to float
        Accuracy on the auxiliary set of each clustered client's model.
    cluster_round_, clustering_seconds_
        As for the base.

    Costs
    -----
    Server memory: the auxiliary set, and during the clustering round the
    predictions of the ``n`` updates, ``n x m x C`` float32 (``m`` auxiliary
    samples, ``C`` classes; each update is reduced to them as soon as it is
    read, no copy of any weights is made), plus the ``n x n`` similarity,
    which is all that is kept afterwards. Server compute: ``n`` forward passes
    over the ``m`` samples, once, and ``O(n^2 m C)`` for ``A``. Bytes per
    round: as FedAvg, one model down and one update up per trained client;
    the auxiliary set never leaves the server. Clients: ordinary local
    training, nothing else.
    """

    name = "flis-hc"

    def __init__(self, *, distance_threshold: float = 0.55, linkage: str = "complete", cluster_round: int = 1,
                 cluster_init: str = "initial", **kw: Any) -> None:
        super().__init__(**kw)
        self.distance_threshold = check_number(distance_threshold, "distance_threshold", low=0.0, high=1.0)
        if linkage not in LINKAGES:
            raise ValueError(f"linkage must be one of {LINKAGES}, got {linkage!r}")
        self.linkage = linkage
        self.cluster_round = check_int(cluster_round, "cluster_round")
        if self.cluster_round > self.max_warmup_rounds:
            raise ValueError(f"cluster_round={cluster_round} is after max_warmup_rounds={self.max_warmup_rounds}, "
                             "the round at which clustering is forced")
        if cluster_init not in CLUSTER_INITS:
            raise ValueError(f"cluster_init must be one of {CLUSTER_INITS}, got {cluster_init!r}")
        self.cluster_init = cluster_init
        self.similarity_: np.ndarray | None = None
        self.similarity_cids_: list[str] = []

    def decide(self, rnd: int, updates: Sequence[Update], reference: Mapping[str, np.ndarray],
               force: bool) -> Sequence[int] | None:
        """Hierarchical clusters of the round's models by inference similarity (from ``cluster_round``)."""
        if rnd < self.cluster_round and not force:
            return None
        reduced = self._reduce(rnd, updates)
        if not reduced:
            return [0] * len(updates)
        s = self._similarity([p for _, p in reduced])
        labels = hierarchical_labels(s, self.distance_threshold, self.linkage)
        self.similarity_ = s
        self.similarity_cids_ = [u.cid for u, _ in reduced]
        _log_similarity(self.name, rnd, s, labels)
        by_cid = dict(zip(self.similarity_cids_, labels.tolist()))
        largest = int(np.argmax(np.bincount(labels)))
        for u in updates:
            if u.cid not in by_cid:
                log.warning("%s: client %s has no predictions; it joins the largest cluster", self.name, u.cid)
        return [by_cid.get(u.cid, largest) for u in updates]

    def aggregate_round(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        was = self.clustered
        summary = super().aggregate_round(rnd, updates)
        if self.clustered and not was and self.cluster_init == "initial":
            for key in self.models:  # Algorithm 3, line 7: every cluster starts from the initial model
                self.models[key] = copy_weights(self._template)
        return summary

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        if self.similarity_ is not None:
            tensors[_PREFIX + "similarity"] = np.asarray(self.similarity_, dtype=np.float64)
            meta["similarity_cids"] = list(self.similarity_cids_)
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        tensors = dict(tensors)
        s = tensors.pop(_PREFIX + "similarity", None)
        super().load_state(meta, tensors)
        self.similarity_ = None if s is None else np.asarray(s, dtype=np.float64)
        self.similarity_cids_ = [str(c) for c in meta.get("similarity_cids", [])]


# --------------------------------------------------------------------------- FLIS-DC


class FLISDC(_AuxInference, Strategy):
    """FLIS (DC): re-cluster every round by thresholding the inference similarity.

    Round 1 trains the initial model. From round 2 each sampled client is
    offered every cluster model of the previous round and trains the one with
    the lowest loss on a local batch (:meth:`edge_sdk.worker.LocalWorker.select`;
    the paper picks by local test accuracy). The server reduces each update to
    its auxiliary-set predictions, forms ``C_i = {j : A_ij >= threshold}`` for
    every participant ``i`` and makes one model per distinct ``C_i``, the
    FedAvg of its members' updates; the previous round's models are replaced.

    A client's cluster (:meth:`clusters`, and the model it is evaluated with)
    is its own ``C_i`` of the last round it trained in. A client that did
    not train in the last round is placed, by its latest predictions, in the
    cluster whose members' models it agrees with most on average; one that
    never trained, in the largest cluster.

    Parameters
    ----------
    threshold : float
        The similarity threshold ``beta`` in [0, 1] (0: FedAvg, 1: about local
        training). Default 0.4, the authors' script; the paper's best lie in
        0.3 to 0.5.
    architecture, aux_path, aux_x, aux_y, inference, predictions, temperature, models_dir
        As for :class:`FLISHC`.
    settings, fraction, seed
        As for :class:`~server_kit.strategy.Strategy`; ``fraction`` of all
        clients is sampled each round.

    Attributes
    ----------
    members_ : list of list of str
        The clients whose updates made each current cluster model (``c{k}``);
        overlapping when the ``C_i`` do.
    assignment_ : dict of str to int
        Each client's cluster.
    predictions_ : dict of str to numpy.ndarray
        Latest ``(m, C)`` float32 probabilities of each client's model.
    similarity_ : numpy.ndarray or None
        The last round's ``(n_t, n_t)`` similarity, rows in ``similarity_cids_`` order.

    Costs
    -----
    Server memory: the auxiliary set, the latest predictions of every client
    that trained, ``n x m x C`` float32 (each update is reduced to them as soon
    as it is read; no weights are kept beyond the driver's round), the round's
    ``n_t x n_t`` similarity and up to ``n_t`` cluster models. Server compute
    per round: ``n_t`` forward passes over the ``m`` samples and
    ``O(n_t^2 m C)``. Bytes per round: every sampled client downloads all
    ``K_t`` cluster models of the previous round (``K_t`` at most that round's
    participants; one in round 1) and uploads one update. Clients: one loss
    evaluation per offered model on a local batch, then local training.
    """

    name = "flis-dc"

    def __init__(self, *, threshold: float = 0.4, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold = check_number(threshold, "threshold", low=0.0, high=1.0)
        self.members_: list[list[str]] = []
        self.assignment_: dict[str, int] = {}
        self.predictions_: dict[str, np.ndarray] = {}
        self.similarity_: np.ndarray | None = None
        self.similarity_cids_: list[str] = []

    def setup(self, clients: Sequence[ClientInfo], template: Weights) -> None:
        super().setup(clients, template)
        self.members_, self.assignment_, self.predictions_ = [], {}, {}
        self.similarity_, self.similarity_cids_ = None, []

    # -- who is where ----------------------------------------------------------
    def cluster_keys(self) -> list[str]:
        """Keys of the current models: ``c0 ... c{K-1}``, or the default key before any clustering."""
        if not self.members_:
            return [self.default_key]
        return [ClusteredFedAvg.key(k) for k in range(len(self.members_))]

    def _largest(self) -> int:
        return int(np.argmax([len(m) for m in self.members_]))

    def model_key_for(self, cid: str) -> str:
        if not self.members_:
            return self.default_key
        return ClusteredFedAvg.key(self.assignment_.get(cid, self._largest()))

    def clusters(self) -> dict[str, int]:
        if not self.members_:
            return super().clusters()
        largest = self._largest()
        return {c: self.assignment_.get(c, largest) for c in sorted(set(self.clients) | set(self.assignment_))}

    def assign_late(self, cid: str, sketch: Any = None, info: ClientInfo | None = None) -> str:
        """A new client is offered every cluster model when it next trains; until then, the largest."""
        if info is not None:
            self.clients[cid] = info
        key = self.model_key_for(cid)
        log.info("%s: late client %s is evaluated with %s until it trains and is clustered", self.name, cid, key)
        return key

    # -- rounds ------------------------------------------------------------------
    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        """Every sampled client is offered all current cluster models."""
        chosen = self.sample([c for c in available if c in self.clients], rnd)
        keys = self.cluster_keys()
        return [Task(c, rnd, {key: self.models[key] for key in keys}, self.settings) for c in chosen]

    def aggregate_round(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        """Threshold the round's inference similarity; one FedAvg model per distinct cluster."""
        usable = []
        for u in sorted(updates, key=lambda u: u.cid):
            if u.model_key not in self.models:
                log.warning("%s round %d: update of %s names unknown model %r; ignored", self.name, rnd, u.cid,
                            u.model_key)
            elif not finite_update(u):
                log.warning("%s round %d: update of %s has non-finite weights; ignored", self.name, rnd, u.cid)
            else:
                usable.append(u)
        reduced = self._reduce(rnd, usable)
        summary: dict[str, Any] = {"updates": len(reduced), "rejected": len(updates) - len(reduced)}
        if not reduced:
            summary["clusters"] = len(self.cluster_keys())
            return summary
        for u, p in reduced:
            self.predictions_[u.cid] = p
        s = self._similarity([p for _, p in reduced])
        labels, sets = distinct_clusters(threshold_clusters(s, self.threshold))
        template = self.models[self.cluster_keys()[0]]
        models, members = {}, []
        for k, rows in enumerate(sets):
            agg = self.new_aggregator(template)
            added = 0
            for j in rows:
                u = reduced[j][0]
                try:
                    agg.add(u.weights, u.n_samples)
                    added += 1
                except ValueError as e:
                    log.warning("%s round %d: update of %s rejected for cluster %d: %s", self.name, rnd, u.cid, k, e)
            models[ClusteredFedAvg.key(k)] = agg.result() if added else copy_weights(template)
            members.append([reduced[j][0].cid for j in rows])
        self.models, self.members_ = models, members
        self.similarity_, self.similarity_cids_ = s, [u.cid for u, _ in reduced]
        self.assignment_ = {u.cid: int(lab) for (u, _), lab in zip(reduced, labels)}
        self._place_absent()
        _log_similarity(self.name, rnd, s, labels)
        log.info("%s round %d: %d clients into %d clusters (sizes %s)", self.name, rnd, len(reduced), len(sets),
                 [len(m) for m in members])
        summary["clusters"] = len(sets)
        return summary

    def _place_absent(self) -> None:
        """Clients with predictions but no update this round join the cluster they agree with most."""
        absent = sorted(set(self.predictions_) - set(self.similarity_cids_))
        if not absent:
            return
        b_round = np.stack([prediction_matrix(self.predictions_[c], self.predictions) for c in self.similarity_cids_])
        b_absent = np.stack([prediction_matrix(self.predictions_[c], self.predictions) for c in absent])
        s = cross_similarity(b_absent, b_round)
        row = {c: j for j, c in enumerate(self.similarity_cids_)}
        for i, cid in enumerate(absent):
            means = [float(np.mean([s[i, row[m]] for m in members])) for members in self.members_]
            self.assignment_[cid] = int(np.argmax(means))

    # -- checkpoints ----------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["members"] = [list(m) for m in self.members_]
        meta["assignment"] = dict(self.assignment_)
        meta["similarity_cids"] = list(self.similarity_cids_)
        meta["threshold"] = self.threshold
        for cid, p in self.predictions_.items():
            tensors[f"{_PREFIX}pred/{cid}"] = p
        if self.similarity_ is not None:
            tensors[_PREFIX + "similarity"] = np.asarray(self.similarity_, dtype=np.float64)
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        mine = {k[len(_PREFIX):]: v for k, v in tensors.items() if k.startswith(_PREFIX)}
        super().load_state(meta, {k: v for k, v in tensors.items() if not k.startswith(_PREFIX)})
        self.members_ = [[str(c) for c in m] for m in meta.get("members", [])]
        self.assignment_ = {str(c): int(k) for c, k in meta.get("assignment", {}).items()}
        self.similarity_cids_ = [str(c) for c in meta.get("similarity_cids", [])]
        self.predictions_ = {k[len("pred/"):]: np.asarray(v, dtype=np.float32)
                             for k, v in mine.items() if k.startswith("pred/")}
        s = mine.get("similarity")
        self.similarity_ = None if s is None else np.asarray(s, dtype=np.float64)
