"""FedCRef's device: :class:`FedCRefClient`, its data, local clusters and models across the phases.

Each phase's math is in :mod:`.clustering`, :mod:`.association` and :mod:`.models`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from ..training.torch_support import using_threads
from ..validation import check_int, check_positive
from .association import (
    association_matrix,
    check_normalization,
    node_key,
)
from .checks import check_alpha, check_cid, check_dirtiness, check_k_range, check_samples
from .clustering import (
    check_init,
    initial_clustering,
)
from .community import CommunityPhases, Payload
from .errors import ErrorTable
from .models import (
    check_architecture,
    import_torch,
    initial_ae_weights,
    join_models,
    split_models,
    train_cluster_ae,
)

__all__ = ["FedCRefClient", "Payload"]

log = logging.getLogger(__name__)


class FedCRefClient(CommunityPhases):
    """One device of a FedCRef federation: its data, clusters and cluster models.

    The server drives it through the methods below, each taking and returning :data:`Payload` objects.

    Parameters
    ----------
    cid : str
        Client id (a topic-safe word).
    x : array-like, shape (n, ...)
        Unlabelled samples in [0, 1] (8x8 or 28x28 images, or 64 or 784 values).
    n_clusters : int, optional
        ``K_i``. None: chosen by silhouette over ``k_range`` (K-means or Ward init);
        the number of true categories (dirty init); the number of distinct
        labels (given init).
    k_range : (int, int)
        Range of ``K_i`` tried by silhouette.
    init : {"kmeans", "ward", "dirty", "given"}
        K-means or Ward on latent codes or pixels (:func:`partition_points`);
        the paper's simulated dirty initialisation from ``true_labels``;
        ``initial_labels`` as they are.
    encoder : "auto", str, object or None
        For K-means and Ward: an :class:`~edge_sdk.encoder.OnnxEncoder` (or any object
        with ``encode(x) -> (n, d)``), an artifact name, ``"auto"`` (the
        shipped ``digits_encoder`` for 64 features, ``fmnist_fc_encoder`` for
        784, pixels otherwise) or None (pixels).
    latents : array-like, optional
        Precomputed latent codes for K-means or Ward (skips the encoder).
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
    own_models : bool
        Publish only models trained on the own clusters (Algorithm 1, line
        8): after a refinement that chose a community model, retrain once
        even when stable. False publishes that community model, whose copies
        pass the association test at 0 whatever their samples.
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
        The latent codes K-means or Ward ran on (None for dirty/given init).
    models_ : dict of int to dict
        Current model of each local cluster.
    silhouette_ : dict of int to float
        Silhouette per K tried (K-means or Ward init with ``n_clusters=None``).
    stability_ : float or None
        Hungarian-matched agreement of the labels before and after the last
        refinement.
    train_seconds_ : float
        Time spent training autoencoders.
    error_table_ : ErrorTable
        Every model's errors on the samples (``error_table_.seconds``: time spent computing them).

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
        own_models: bool = True,
        warm_start: bool = False,
        init_seed: int = 0,
        seed: int = 0,
        threads: Optional[int] = None,
    ) -> None:
        self.cid = check_cid(cid)
        self.x = check_samples(x)
        self.init = check_init(init)
        self.n_clusters = None if n_clusters is None else check_int(n_clusters, "n_clusters")
        self.k_range = check_k_range(k_range)
        self.encoder = encoder
        self.latents = latents
        self.true_labels = true_labels
        self.initial_labels = initial_labels
        self.dirtiness = check_dirtiness(dirtiness)
        self.architecture = check_architecture(architecture, self.x.shape[1])
        self.epochs = check_int(epochs, "epochs")
        self.lr = check_positive(lr, "lr")
        self.batch_size = check_int(batch_size, "batch_size")
        self.community_epochs = check_int(community_epochs, "community_epochs")
        self.alpha = check_alpha(alpha)
        self.normalization = check_normalization(normalization)
        self.link_communities = bool(link_communities)
        self.own_models = bool(own_models)
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
        self._own_versions: dict[int, str] = {}  # cluster -> id of the model now representing it
        self._published: Optional[tuple[str, ...]] = None
        self._defining: dict[int, dict[str, np.ndarray]] = {}  # cluster -> model that defined it (warm start)
        self._ext: dict[str, tuple[str, dict[str, np.ndarray]]] = {}  # node -> (version, weights)
        self.error_table_ = ErrorTable(self.architecture, self.x, self.threads)
        self._counter = 0
        self._adopted = False  # a community model now stands for one of the clusters

    def _check_ready(self) -> np.ndarray:
        if self.labels_ is None:
            raise RuntimeError(f"client {self.cid}: call initialize() first")
        return self.labels_

    def _node_errors(self, key: str) -> np.ndarray:
        """Errors on the local samples of the model of node ``key`` (an own cluster's or a received one)."""
        owner, _, q = key.rpartition(":")
        if owner != self.cid:
            return self.error_table_.of(key, *self._ext[key])
        return self.error_table_.of(f"own:{q}", self._own_versions[int(q)], self.models_[int(q)])

    def _new_version(self) -> str:
        self._counter += 1
        return f"{self.cid}.{self._counter}"

    def _set_labels(self, labels: np.ndarray) -> None:
        _, compact = np.unique(labels, return_inverse=True)
        self.labels_ = compact.astype(np.int64)
        self.n_clusters_ = int(self.labels_.max()) + 1

    # ------------------------------------------------------------------ phase 0: initial clustering

    def initialize(self) -> Payload:
        """Initial local clustering; returns the hello object ``(meta, {})``.

        Returns
        -------
        (dict, dict)
            ``meta`` = ``{"type": "hello", "cid", "n_samples", "n_features",
            "n_clusters", "architecture", "init"}``, no tensors.
        """
        labels, latents, silhouette = initial_clustering(
            self.x, self.init, n_clusters=self.n_clusters, k_range=self.k_range, encoder=self.encoder,
            latents=self.latents, true_labels=self.true_labels, initial_labels=self.initial_labels,
            dirtiness=self.dirtiness, seed=self.seed,
        )
        self.latents_ = self.latents_ if latents is None else latents  # None: not computed (dirty, given)
        self.silhouette_ = self.silhouette_ if silhouette is None else silhouette  # None: K was given
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
        train = bool(command.get("train", True)) or not self.models_ or (self.own_models and self._adopted)
        if train:
            torch = import_torch()
            t0 = time.perf_counter()
            base = initial_ae_weights(self.architecture, self.init_seed)
            models: dict[int, dict[str, np.ndarray]] = {}
            with using_threads(torch, self.threads):
                for q in range(self.n_clusters_):
                    members = self.x[labels == q]
                    start = self._defining.get(q, base) if self.warm_start else base
                    models[q], _ = train_cluster_ae(
                        self.architecture, start, members, epochs=self.epochs, lr=self.lr,
                        batch_size=self.batch_size, seed=self.seed * 7919 + it * 131 + q,
                    )
            self.train_seconds_ += time.perf_counter() - t0
            self._adopted = False
            self.models_ = models
            self._own_versions = {q: self._new_version() for q in models}
        versions = tuple(self._own_versions[q] for q in sorted(self.models_))
        if versions == self._published:
            return None
        self._published = versions
        counts = np.bincount(labels, minlength=self.n_clusters_)
        meta = {"type": "cluster_models", "cid": self.cid, "iteration": it, "architecture": self.architecture,
                "clusters": [{"q": int(q), "n": int(counts[q]), "version": self._own_versions[q]}
                             for q in sorted(self.models_)]}
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
            self.error_table_.drop(key)
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
        own_err = {q: self._node_errors(node_key(self.cid, q)) for q in own}
        stat = association_matrix(labels, own_err, [self._node_errors(k) for k in ext], self.alpha, self.normalization)
        meta = {"type": "association", "cid": self.cid, "iteration": it,
                "clusters": [node_key(self.cid, q) for q in own], "external": ext, "alpha": self.alpha,
                "normalization": self.normalization}
        return meta, {"stat": stat}
