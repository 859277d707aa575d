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
classes, in :mod:`server_kit.strategies.flis_math`. Inference runs with torch
when installed, else with ONNX Runtime on the architecture's shipped
classifier template (:mod:`edge_sdk.training.trainer`); the auxiliary set and the
inference both variants share are in :mod:`server_kit.strategies.flis_aux`.
Every public name of those two modules is importable from here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Task, Update
from edge_sdk.validation import check_choice, check_int, check_number

from .base import ClientInfo, Strategy, Weights, copy_weights
from .capabilities import Capabilities
from .clustered import ClusteredFedAvg
from .flis_aux import INFERENCE, AuxInference, aux_logits, check_aux, load_aux
from .flis_math import (
    LINKAGES,
    PREDICTIONS,
    cross_similarity,
    distinct_clusters,
    hierarchical_labels,
    inference_similarity,
    prediction_matrix,
    softmax,
    threshold_clusters,
)
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

#: Where FLIS-HC's clusters start: the initial model (paper) or the global model after the round.
CLUSTER_INITS: tuple[str, ...] = ("initial", "global")

_PREFIX = "_flis/"


def _log_similarity(name: str, rnd: int, s: np.ndarray, labels: Sequence[int]) -> None:
    lab = np.asarray(labels)
    same = np.equal.outer(lab, lab) & ~np.eye(len(lab), dtype=bool)
    within = float(s[same].min()) if same.any() else float("nan")
    between = float(s[~np.equal.outer(lab, lab)].max()) if len(set(lab.tolist())) > 1 else float("nan")
    log.info("%s round %d: inference similarity within clusters >= %.3f, between <= %.3f", name, rnd, within,
             between)


# --------------------------------------------------------------------------- FLIS-HC


class FLISHC(AuxInference, UpdateClustered):
    """FLIS (HC): cluster once, hierarchically, by the inference similarity of the first models.

    Parameters
    ----------
    architecture : str
        Classifier key of :data:`edge_sdk.training.nets.ARCHITECTURES` the clients train
        (:func:`~server_kit.strategies.make_strategy` passes the driver's).
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
        check_choice(linkage, "linkage", LINKAGES, LINKAGES)
        self.linkage = linkage
        self.cluster_round = check_int(cluster_round, "cluster_round")
        if self.cluster_round > self.max_warmup_rounds:
            raise ValueError(f"cluster_round={cluster_round} is after max_warmup_rounds={self.max_warmup_rounds}, "
                             "the round at which clustering is forced")
        check_choice(cluster_init, "cluster_init", CLUSTER_INITS, CLUSTER_INITS)
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

    def _combine(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        was = self.clustered
        summary = super()._combine(rnd, updates)
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


class FLISDC(AuxInference, Strategy):
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
        As for :class:`~server_kit.strategies.base.Strategy`; ``fraction`` of all
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
    capabilities = Capabilities(
        refuses_compression=("it clusters the devices every round by running their whole trained models on its "
                             "auxiliary set; a compressed update would give it another model"),
        refuses_partials="it runs each device's trained model on its auxiliary set; a partial sum mixes them")

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

    def is_clustered(self, cid: str) -> bool:
        return cid in self.clients or (bool(self.members_) and cid in self.assignment_)

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
        chosen = self._sample([c for c in available if c in self.clients], rnd)
        keys = self.cluster_keys()
        return [Task(c, rnd, {key: self.models[key] for key in keys}, self.settings) for c in chosen]

    def _combine(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
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
            agg = self._new_aggregator(template)
            added = 0
            for j in rows:
                u = reduced[j][0]
                try:
                    agg.add(u.weights, u.n_samples, tag=u.cid)
                    added += 1
                except ValueError as e:
                    log.warning("%s round %d: update of %s rejected for cluster %d: %s", self.name, rnd, u.cid, k, e)
            for refused in agg.settle():
                log.warning("%s round %d: update of %s rejected for cluster %d: %s", self.name, rnd, refused.tag, k,
                            refused.message)
                added -= 1
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
