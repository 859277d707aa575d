"""Ours (Prigent et al.): cluster once, before training, from client sketches; FedAvg per cluster."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from edge_sdk.sketch import Sketch, stack_sketches
from edge_sdk.tasks import TrainSettings

from ..pretrain.settings import pretrain_config
from .base import RESKETCH_SALT, ClientInfo, copy_weights
from .capabilities import Capabilities
from .clustered import ClusteredFedAvg
from .drift import WARMUP_EPOCHS, DriftReport, DriftTracker

__all__ = ["FedAESketchClustered", "SketchClustered"]

log = logging.getLogger(__name__)


class SketchClustered(ClusteredFedAvg):
    """Ours (Prigent et al.): cluster once, before training, from client sketches.

    Sketches are clustered by :class:`server_kit.clustering.SketchClustering`
    (Hamming clipped per class block, Ward linkage built once, threshold by Bayesian
    optimisation of the Calinski-Harabasz index); then FedAvg per cluster. A
    late client's sketch joins the nearest cluster centroid.

    With ``follow_drift`` (or ``resketch_every``), sketches that arrive during
    training move devices between clusters, pool those that fit none and make
    new clusters from the pool (:mod:`server_kit.strategies.drift`); the
    drivers ask the fleet for fresh sketches every ``resketch_every`` rounds,
    and a device whose data changed sends one unasked. Off by default: the
    paper's method clusters once.

    With ``clip_noise`` (the default), each class block's Hamming distance is
    clipped (:mod:`server_kit.clustering.distances`): the uniform noise of the
    classes a client lacks then weighs little, which small federations of
    clients holding few classes need. ``clip_noise=False``: plain Hamming, as
    in the paper.
    """

    name = "fedsketch"
    capabilities = Capabilities(needs_sketches=True)

    def __init__(self, *, min_cluster_size: int = 2, clustering: Mapping[str, Any] | None = None,
                 pretrain: Mapping[str, Any] | None = None, follow_drift: bool = False,
                 resketch_every: int | None = None, drift_z: float = 4.0, flip_prob: float = 0.1,
                 clip_noise: bool = True, **kw: Any) -> None:
        super().__init__(**kw)
        # Loaded with the strategy, before a fleet connects: scikit-learn, SciPy and scikit-optimize take a
        # second or two to import, which a fleet would otherwise wait through in the clustering phase.
        from ..clustering import SketchClustering

        self._estimator = SketchClustering
        self.min_cluster_size = int(min_cluster_size)
        if not isinstance(clip_noise, bool):
            raise ValueError(f"clip_noise must be true or false, got {clip_noise!r}")
        self.clip_noise = clip_noise
        self.clustering_params = dict(clustering or {})
        #: What follows drift during training, or None (the paper's method: cluster once).
        self.drift_: DriftTracker | None = None
        if follow_drift or resketch_every is not None:
            self.drift_ = DriftTracker(resketch_every=resketch_every, flip_prob=flip_prob, z=drift_z,
                                       min_cluster_size=self.min_cluster_size, random_state=self.seed,
                                       clustering=self.clustering_params)
        # Federated AE pre-training settings (see :func:`pretrain_config`), or None: the drivers then sketch
        # with the server's encoder as shipped; sketches during training are acted on with a drift tracker.
        self.capabilities = replace(type(self).capabilities, follows_drift=self.drift_ is not None,
                                    pretrain=None if pretrain is None else pretrain_config(pretrain))
        self.model_: Any = None

    def on_sketches(self, sketches: Mapping[str, Sketch]) -> dict[str, int]:
        if not sketches:
            raise ValueError("no sketches to cluster")
        cids = sorted(sketches)
        first = sketches[cids[0]]
        packed = stack_sketches([sketches[c] for c in cids])
        if self.clip_noise and "block_bits" not in self.clustering_params:
            self._use_block_bits(first.latent_dim)
        self.model_ = self._estimator(
            min_cluster_size=self.min_cluster_size, random_state=self.seed, **self.clustering_params
        ).fit(packed, first.n_bits)
        assignment = {c: int(k) for c, k in zip(cids, self.model_.labels_)}
        log.info(
            "clustered %d sketches of %d bits into %d clusters (threshold %.3g)",
            len(cids), first.n_bits, self.model_.n_clusters_, self.model_.threshold_,
        )
        self.set_assignment(assignment)
        if self.drift_ is not None:
            self.drift_.start({c: row for c, row in zip(cids, packed)}, assignment, first.n_bits)
        return assignment

    def cluster_fraction(self, cluster: int, rnd: int) -> float | None:
        """A cluster made from drifted devices trains all of them for its first rounds (it starts far behind)."""
        if self.drift_ is not None and self.drift_.young(cluster, rnd):
            return 1.0
        return None

    def cluster_settings(self, cluster: int, rnd: int) -> TrainSettings:
        """A young cluster's devices train :data:`~.drift.WARMUP_EPOCHS` times the epochs (no extra bytes)."""
        if self.drift_ is not None and self.drift_.young(cluster, rnd):
            return replace(self.settings, epochs=self.settings.epochs * WARMUP_EPOCHS)
        return self.settings

    def resketch_asked(self, rnd: int, candidates: Sequence[str]) -> list[str]:
        """In the rounds the drift tracker wants fresh sketches (``resketch_every``), a seeded share of ``candidates``."""
        if self.drift_ is None or not self.drift_.due(rnd):
            return []
        return self._sample(candidates, rnd, RESKETCH_SALT)

    def on_resketch(self, rnd: int, sketches: Mapping[str, Sketch]) -> DriftReport | None:
        """Move, pool or regroup devices from their fresh sketches; new clusters get their models here."""
        if self.drift_ is None:
            return None
        report = self.drift_.observe(rnd, {c: s.packed() for c, s in sketches.items()}, self.assignment)
        for new in report.new_clusters:
            src = new["started_from"]
            start = self.models[self.key(src)] if src is not None and self.key(src) in self.models else self._template
            self.models[self.key(new["cluster"])] = copy_weights(start)
        for k in report.retired:
            self.models.pop(self.key(k), None)
        return report

    def assign_late(self, cid: str, sketch: Sketch | None = None, info: ClientInfo | None = None) -> str:
        if info is not None:
            self.clients[cid] = info
        if cid in self.assignment:
            return self.key(self.assignment[cid])
        if self.model_ is None or sketch is None:
            raise ValueError(f"late client {cid!r} needs a sketch and a fitted clustering")
        k = int(self.model_.predict(sketch.packed()[None])[0])
        self.assignment[cid] = k
        log.info("late client %s joins cluster %d (nearest centroid)", cid, k)
        return self.key(k)

    def _use_block_bits(self, block_bits: int) -> None:
        """Clip the distances per class block of ``block_bits``, here and in drift's pool clustering."""
        self.clustering_params["block_bits"] = int(block_bits)
        if self.drift_ is not None:  # the pool's clustering measures as this one does
            self.drift_.clustering["block_bits"] = int(block_bits)

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        if self.model_ is not None:
            tensors["_clustering/centroids"] = np.asarray(self.model_.centroids_, dtype=np.float64)
            meta["n_bits"] = int(self.model_.n_bits_)
        if self.clustering_params.get("block_bits") is not None:
            meta["block_bits"] = int(self.clustering_params["block_bits"])
        if self.drift_ is not None and self.drift_.migration is not None:
            drift_meta, drift_tensors = self.drift_.state()
            meta["drift"] = drift_meta
            tensors.update(drift_tensors)
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        tensors = dict(tensors)
        centroids = tensors.pop("_clustering/centroids", None)
        drift = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("_drift/")]}
        if self.drift_ is not None and "drift" in meta:
            self.drift_.load_state(meta["drift"], drift)
        super().load_state(meta, tensors)
        if self.clip_noise and meta.get("block_bits") is not None and "block_bits" not in self.clustering_params:
            self._use_block_bits(int(meta["block_bits"]))
        if centroids is not None:
            from ..clustering import SketchClustering

            self.model_ = SketchClustering.from_centroids(np.asarray(centroids), int(meta["n_bits"]))


class FedAESketchClustered(SketchClustered):
    """Ours with federated autoencoder pre-training (paper, Section V).

    :class:`SketchClustered` whose drivers first train the sketch autoencoder
    by FedAvg over the clients' own images, export its encoder and send it to
    every client, which then sketches with it. ``pretrain`` defaults to
    :data:`~server_kit.pretrain.settings.PRETRAIN_DEFAULTS`, with the
    architecture of the server's encoder.
    """

    name = "fedsketch-fedae"

    def __init__(self, *, pretrain: Mapping[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(pretrain=dict(pretrain or {}), **kw)
