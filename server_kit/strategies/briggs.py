"""Briggs et al. (2020), FL+HC: hierarchical clustering of the client updates after a fixed round.

FedAvg of one global model with all clients until ``cluster_round``; the
updates ``delta_i = w_i - w_dispatched`` of that round are compared pairwise
(cosine or Euclidean distance), clustered by agglomerative hierarchical
clustering (scipy's ``linkage``, average linkage by default) and the tree is
cut at ``distance_threshold`` (``fcluster(criterion="distance")``): clients
whose clusters merge at or below the threshold share a cluster, so the
federation stays one cluster when everything merges below it. Each cluster
then trains by FedAvg from the global model
(:class:`~server_kit.strategies.update_clustered.UpdateClustered`).

The threshold is the method's one sensitive parameter (the OCFL paper had to
search 0.05 to 0.4 for it and still saw it fail to split). Its default for
the cosine metric, 0.5, is the point halfway between aligned updates
(distance 0) and orthogonal ones (distance 1): under average linkage, two
groups stay apart when their members' updates are on average more than 60
degrees apart. Measured on the digits rotation federation of the tests (12
clients, 3 or 4 rotation groups): at rounds 3 and 4 the true groups are
complete at heights 0.44 to 0.55 and start merging at 0.62 to 0.89; a
homogeneous federation becomes one cluster at 0.49 and 0.50 at rounds 2 and 3
but only at 0.66 and 0.82 at rounds 4 and 1. Tune it (and the round) for the
task. Euclidean distances
scale with the model and the learning rate, so with ``metric="euclidean"``
the threshold must be given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Update
from edge_sdk.validation import check_choice, check_int, check_number

from ..clustering.hierarchy import cut_tree
from ..clustering.updates import (
    cosine_distances_from_gram,
    delta_gram,
    euclidean_distances_from_gram,
)
from .update_clustered import UpdateClustered

__all__ = ["Briggs", "LINKAGES", "METRICS"]

log = logging.getLogger(__name__)

#: Distance between updates, from their Gram matrix.
METRICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "cosine": cosine_distances_from_gram,
    "euclidean": euclidean_distances_from_gram,
}

#: Linkage criteria (scipy's names); "ward" only with Euclidean distances.
LINKAGES = ("average", "complete", "single", "ward")

#: Default threshold per metric (None: must be given).
DEFAULT_THRESHOLDS: dict[str, float | None] = {"cosine": 0.5, "euclidean": None}


class Briggs(UpdateClustered):
    """Agglomerative clustering of the updates of round ``cluster_round``, cut at a distance threshold.

    Parameters
    ----------
    cluster_round : int
        The round whose updates are clustered (1: right after the first
        round); at most ``max_warmup_rounds``.
    distance_threshold : float, optional
        Cut height of the tree, in units of ``metric``, > 0. None: 0.5 for
        cosine (module docstring); required for Euclidean.
    linkage : {"average", "complete", "single", "ward"}
        Linkage criterion; ``"ward"`` needs ``metric="euclidean"``.
    metric : {"cosine", "euclidean"}
        Distance between two clients' updates (cosine: ``1 - cos``, in [0, 2]).
    max_warmup_rounds, warmup_fraction, shared_prefixes, settings, fraction, seed
        As for :class:`~server_kit.strategies.update_clustered.UpdateClustered`.

    Attributes
    ----------
    distance_threshold_ : float
        The threshold in use.
    distances_ : numpy.ndarray or None
        ``(n, n)`` distances of the clustered round (not checkpointed).
    linkage_ : numpy.ndarray or None
        scipy's ``(n - 1, 4)`` linkage matrix of that round (checkpointed):
        merge heights in column 2.

    Costs
    -----
    Server memory: the updates of the clustering round (held by the driver
    anyway), an ``(n, n)`` float64 Gram and distance matrix and an
    ``n x 2^18`` block while the Gram is accumulated; never the stacked
    ``(n, d)`` updates. Server time: the Gram, ``O(n^2 d)``, once, and the
    linkage, ``O(n^2)`` to ``O(n^3)``. Bytes: during the ``cluster_round``
    warm-up rounds every client downloads the global model and uploads its
    weights each round; afterwards one cluster model down and one update up
    per sampled client; no extra message. Clients: ordinary local training.
    """

    name = "briggs"

    def __init__(self, *, cluster_round: int = 1, distance_threshold: float | None = None,
                 linkage: str = "average", metric: str = "cosine", **kw: Any) -> None:
        super().__init__(**kw)
        self.cluster_round = check_int(cluster_round, "cluster_round")
        if self.cluster_round > self.max_warmup_rounds:
            raise ValueError(f"cluster_round must be <= max_warmup_rounds={self.max_warmup_rounds}, "
                             f"got {cluster_round!r}")
        check_choice(metric, "metric", METRICS, sorted(METRICS))
        check_choice(linkage, "linkage", LINKAGES)
        if linkage == "ward" and metric != "euclidean":
            raise ValueError(f"linkage 'ward' needs metric 'euclidean', got metric {metric!r}")
        self.metric = metric
        self.linkage = linkage
        self.distance_threshold = distance_threshold
        if distance_threshold is None:
            default = DEFAULT_THRESHOLDS[metric]
            if default is None:
                raise ValueError(f"distance_threshold is required with metric {metric!r}: its distances "
                                 "scale with the model and the learning rate")
            self.distance_threshold_ = default
        else:
            self.distance_threshold_ = check_number(distance_threshold, "distance_threshold", low=0.0,
                                                    low_open=True)
        self.distances_: np.ndarray | None = None
        self.linkage_: np.ndarray | None = None

    def decide(self, rnd: int, updates: Sequence[Update], reference: Mapping[str, np.ndarray],
               force: bool) -> list[int] | None:
        if rnd < self.cluster_round and not force:
            return None
        gram = delta_gram([u.weights for u in updates], reference)
        d = METRICS[self.metric](gram)
        labels, z = cut_tree(d, self.distance_threshold_, self.linkage)
        self.distances_, self.linkage_ = d, z
        heights = np.round(z[-3:, 2], 4).tolist() if len(z) else []
        log.info("Briggs round %d: %s %s linkage of %d updates cut at %.4g -> %d clusters (top merges at %s)",
                 rnd, self.metric, self.linkage, len(updates), self.distance_threshold_,
                 len(np.unique(labels)), heights)
        return labels.tolist()

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["linkage"] = None if self.linkage_ is None else self.linkage_.tolist()
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        super().load_state(meta, tensors)
        z = meta.get("linkage")
        self.linkage_ = None if z is None else np.asarray(z, dtype=np.float64).reshape(-1, 4)
