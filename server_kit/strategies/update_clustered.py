"""Base of the methods that cluster once from what the clients' trained models say.

OCFL, Briggs et al., K-means on weights and FLIS share one life cycle:

1. **warm-up**: one global model trained by FedAvg; every available client
   trains each round (``warmup_fraction`` of them if set lower), because a
   client can only be clustered from an update it sent;
2. at the end of each warm-up round the method's :meth:`decide` sees the
   round's updates and the model they started from, and either returns a
   cluster for every client that sent one, or None to wait another round;
3. **clustered**: every cluster starts from the global model as it stands
   after that round (children inherit the parent model) and trains by FedAvg
   per cluster (:class:`~server_kit.strategies.clustered.ClusteredFedAvg`, with
   ``fraction`` of each cluster per round and optional shared layers).

A client that sent no update in the deciding round, or registers later,
joins the largest cluster (an update-based method has nothing to place it
by before it trains); the log says so. ``max_warmup_rounds`` bounds the
warm-up: at that round the method must decide (``force=True``).

Memory: the driver holds the round's updates until the round closes, as for
every method; the distance structure is computed from them tensor by tensor
(:mod:`server_kit.clustering.updates`), never as a stacked ``(n, d)`` copy,
unless a method says otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Task, Update
from edge_sdk.validation import check_int, check_number

from .base import ClientInfo
from .capabilities import Capabilities
from .clustered import ClusteredFedAvg

__all__ = ["UpdateClustered"]

log = logging.getLogger(__name__)


class UpdateClustered(ClusteredFedAvg):
    """FedAvg until :meth:`decide` clusters the clients from their updates; then FedAvg per cluster.

    Parameters
    ----------
    max_warmup_rounds : int
        The round at which the method must decide at the latest.
    warmup_fraction : float
        Fraction of the available clients trained per warm-up round (1.0: all,
        so that every client is clustered from its own update).
    shared_prefixes, settings, fraction, seed
        As for :class:`~server_kit.strategies.clustered.ClusteredFedAvg`; ``fraction``
        applies per cluster after clustering.

    Attributes
    ----------
    cluster_round_ : int or None
        The round whose updates decided the clusters.
    clustering_seconds_ : float
        Server time spent in :meth:`decide`, all warm-up rounds together.
    """

    name = "update-clustered"
    capabilities = Capabilities(
        refuses_compression=("it clusters the devices by their whole model updates; a compressed update is "
                             "another vector, and the clusters would change"),
        refuses_partials="it clusters the devices by each one's model update; a partial sum mixes them")

    def __init__(self, *, max_warmup_rounds: int = 10, warmup_fraction: float = 1.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_warmup_rounds = check_int(max_warmup_rounds, "max_warmup_rounds")
        self.warmup_fraction = check_number(warmup_fraction, "warmup_fraction", low=0.0, high=1.0, low_open=True)
        self.cluster_round_: int | None = None
        self.clustering_seconds_ = 0.0

    # -- the method's part ---------------------------------------------------
    def decide(self, rnd: int, updates: Sequence[Update], reference: Mapping[str, np.ndarray],
               force: bool) -> Sequence[int] | None:
        """Cluster labels for ``updates`` (same order), or None to keep warming up.

        ``reference`` is the global model the updates started from. With
        ``force`` the method must return labels. Labels are any integers;
        the base renumbers them.
        """
        raise NotImplementedError

    # -- life cycle ------------------------------------------------------------
    @property
    def clustered(self) -> bool:
        return bool(self.assignment)

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        if self.clustered:
            return super().configure_round(rnd, available)
        pool = sorted(c for c in available if c in self.clients)
        if self.warmup_fraction < 1.0:
            saved, self.fraction = self.fraction, self.warmup_fraction
            try:
                pool = self._sample(pool, rnd)
            finally:
                self.fraction = saved
        model = self.models[self.default_key]
        return [Task(c, rnd, {self.default_key: model}, self.settings) for c in pool]

    def _combine(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        if self.clustered:
            return super()._combine(rnd, updates)
        reference = self.models[self.default_key]
        usable = [u for u in updates if u.model_key == self.default_key and finite_update(u)]
        kept = {id(u) for u in usable}
        for u in updates:
            if id(u) not in kept:
                log.warning("round %d: update of %s not used for clustering (model %r or non-finite weights)",
                            rnd, u.cid, u.model_key)
        summary = super()._combine(rnd, updates)  # FedAvg of the global model
        usable = sorted(usable, key=lambda u: u.cid)
        force = rnd >= self.max_warmup_rounds
        if not usable:
            return summary
        t0 = time.perf_counter()
        labels = self.decide(rnd, usable, reference, force)
        self.clustering_seconds_ += time.perf_counter() - t0
        if labels is None:
            if force:
                raise RuntimeError(f"{self.name}: decide() returned no labels at the forced round {rnd}")
            return summary
        labels = list(labels)
        if len(labels) != len(usable):
            raise RuntimeError(f"{self.name}: {len(labels)} labels for {len(usable)} updates")
        order = {lab: j for j, lab in enumerate(dict.fromkeys(int(x) for x in labels))}
        assignment = {u.cid: order[int(lab)] for u, lab in zip(usable, labels)}
        sizes = np.bincount(list(assignment.values()))
        largest = int(np.argmax(sizes))
        for cid in sorted(self.clients):
            if cid not in assignment:
                assignment[cid] = largest
                log.warning("%s: client %s sent no update in round %d; it joins the largest cluster %d",
                            self.name, cid, rnd, largest)
        self.cluster_round_ = rnd
        self.set_assignment(assignment)
        log.info("%s: clustered %d clients into %d clusters at round %d (sizes %s, %.3f s)", self.name,
                 len(assignment), len(sizes), rnd, sizes.tolist(), self.clustering_seconds_)
        summary["clusters"] = int(len(sizes))
        return summary

    def assign_late(self, cid: str, sketch: Any = None, info: ClientInfo | None = None) -> str:
        if info is not None:
            self.clients[cid] = info
        if not self.clustered or cid in self.assignment:
            return self.model_key_for(cid)
        sizes = np.bincount(list(self.assignment.values()))
        self.assignment[cid] = int(np.argmax(sizes))
        log.info("%s: late client %s joins the largest cluster %d", self.name, cid, self.assignment[cid])
        return self.key(self.assignment[cid])

    # -- checkpoints --------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["cluster_round"] = self.cluster_round_
        meta["clustering_seconds"] = self.clustering_seconds_
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        super().load_state(meta, tensors)
        self.cluster_round_ = meta.get("cluster_round")
        self.clustering_seconds_ = float(meta.get("clustering_seconds", 0.0))


def finite_update(u: Update) -> bool:
    """Whether every floating tensor of an update is finite (no NaN, no infinity)."""
    return all(np.isfinite(np.asarray(v)).all() for v in u.weights.values()
               if np.issubdtype(np.asarray(v).dtype, np.floating))
