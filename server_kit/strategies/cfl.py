"""CFL (Sattler et al.): recursive bipartitions of clusters whose clients pull apart.

Clustered Federated Learning (Sattler, Müller and Samek, "Clustered
Federated Learning: model-agnostic distributed multitask optimization under
privacy constraints", IEEE TNNLS 2020) starts with one cluster of all clients
and runs FedAvg in every cluster. At the end of each round, every cluster
looks at the updates ``delta_i = w_i - w_dispatched`` of its clients:

* ``mean_norm``: the norm of the clients' mean update, weighted by their
  sample counts (the FedAvg step, as in the paper's Algorithm 1; the authors'
  code takes the unweighted mean, the same thing for equal-sized clients);
* ``max_norm``: the largest update norm of a client.

When ``mean_norm < eps1`` (the cluster's joint model is near a stationary
point) while ``max_norm > eps2`` (some clients still want to move away), the
cluster is split in two by the cosine similarities of its clients' updates
(:func:`optimal_bipartition`). The split is recursive: each child is tested
again in later rounds and may split further.

Choices made here (the paper leaves them open):

* **Child models**: each child starts from the parent model as dispatched in
  the splitting round plus the FedAvg of its own members' updates of that
  round (what the authors' code does, aggregating over the new clusters), so
  no client's round of training is lost. With ``shared_prefixes`` the shared
  layers are the average over all clients, as in
  :class:`~server_kit.strategies.clustered.ClusteredFedAvg`.
* **Members without an update** in the splitting round (``fraction < 1``,
  dropped clients, a rejected NaN update) cannot be placed by their update:
  they join the larger child (ties: the child of the first client by id),
  and the log says so. A client that registers later joins the largest
  cluster (:meth:`CFL.assign_late`).
* **Bipartition**: complete linkage on the cosine distances, cut in two (the
  authors' code: ``AgglomerativeClustering(linkage="complete")`` on the
  negated similarities, which gives the same tree), or single linkage, which
  is the paper's Algorithm 2 and the exact minimiser of the largest
  cross-cluster similarity.
* **Sizes**: a cluster is only tested with at least ``2 * min_cluster_size``
  updates, and a bipartition with a child smaller than ``min_cluster_size``
  (counted among the clients that sent updates) is refused.
* ``eps1 <= eps2`` is required: the mean update is never longer than the
  longest client update, so with ``eps1 > eps2`` a cluster whose clients all
  still move together (mean norm between ``eps2`` and ``eps1``) would be
  split, which is not the criterion's intent (split only at a joint
  stationary point where the clients disagree).

**The thresholds depend on the model, the optimiser and its learning rate**
(update norms scale with the learning rate and the number of local steps):
the FL-bench defaults ``eps1 = 0.4``, ``eps2 = 1.6`` are for its models and
must be tuned per model; look at :attr:`CFL.last_norms_` (also in each
round's summary) over a few rounds of the intended setting first. An
example: on the 8x8 digits CNN trained with Adam (lr 0.01, 2 local epochs,
batch 64), 12 clients in rounds 1-5 gave mean norms 1.0-1.6 and max norms
1.5-2.4, alike for 4 rotation groups and for a homogeneous federation
(likely because Adam's steps, unlike SGD's, do not shrink near a stationary
point); what told them apart was the largest cross-part cosine similarity of
the bipartition (0.20-0.38 in the splits of the rotation groups, 0.52-0.64
in rounds 3-5 of the homogeneous federation, falling to 0.46 by round 7),
that is, the ``gamma_max`` test. Without it the homogeneous federation was
split as well.

Costs
-----
Server memory: one model per cluster, plus, while a round is aggregated, one
``n_c x chunk`` float64 buffer (``chunk`` = 2**18 values) for the norms, and
when a cluster is tested for a split its ``n_c x n_c`` Gram matrix
(:func:`server_kit.clustering.updates.delta_gram`); the updates are never
stacked into an ``(n, d)`` matrix. Server work per round: the norms are one
pass over the updates (``O(n d)``, like FedAvg); the Gram matrix
(``O(n_c^2 d)``) and the linkage (``O(n_c^2)``) only for a
cluster that meets the norm criterion. Bytes per round: those of FedAvg, one
model down and one update up per participating client; nothing else is sent.
Clients: ordinary local training of their cluster's model, nothing more.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Update
from edge_sdk.validation import check_choice, check_int, check_number

from ..clustering.updates import CHUNK, cosine_distances_from_gram, delta_chunks, delta_gram
from .base import ClientInfo, Weights, copy_weights
from .capabilities import Capabilities
from .clustered import ClusteredFedAvg

__all__ = ["CFL", "LINKAGES", "max_cross_similarity", "optimal_bipartition", "update_norm_stats"]

log = logging.getLogger(__name__)

#: Linkages :func:`optimal_bipartition` knows.
LINKAGES = ("complete", "single")


def update_norm_stats(updates: Sequence[Weights], reference: Weights, weights: Sequence[float] | None = None,
                      *, chunk: int = CHUNK) -> tuple[np.ndarray, float]:
    """Norm of every update and of their (weighted) mean, in one pass.

    Parameters
    ----------
    updates : sequence of mapping
        The clients' trained weights.
    reference : mapping
        The model they started from; deltas are ``updates[i] - reference``
        over the floating-point tensors (see
        :func:`server_kit.clustering.updates.delta_chunks`).
    weights : sequence of float, optional
        Weights of the mean (sample counts); default equal.
    chunk : int
        Values per column chunk (memory ``n x chunk`` float64).

    Returns
    -------
    norms : numpy.ndarray
        ``(n,)`` Euclidean norms ``||delta_i||``.
    mean_norm : float
        ``||sum_i w_i delta_i|| / sum_i w_i``.
    """
    n = len(updates)
    if n == 0:
        raise ValueError("update_norm_stats needs at least one update")
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be {n} non-negative values with a positive sum, got {weights!r}")
    w = w / w.sum()
    sq = np.zeros(n, dtype=np.float64)
    mean_sq = 0.0
    for block in delta_chunks(updates, reference, chunk=chunk):
        sq += np.einsum("ij,ij->i", block, block)
        m = w @ block
        mean_sq += float(m @ m)
    return np.sqrt(sq), math.sqrt(mean_sq)


def optimal_bipartition(similarity: np.ndarray, linkage: str = "complete") -> np.ndarray:
    """Split clients in two by hierarchical clustering of their pairwise similarities.

    The tree is built on the distances ``1 - similarity`` and cut at its
    root. ``"complete"`` is what Sattler et al.'s code does;
    ``"single"`` (the paper's Algorithm 2: merge the most similar pairs
    until two groups are left) minimises ``max_{i in A, j in B} S[i, j]``
    over all bipartitions exactly.

    Parameters
    ----------
    similarity : numpy.ndarray
        ``(n, n)`` symmetric similarities (cosines in [-1, 1]), n >= 2.
    linkage : {"complete", "single"}

    Returns
    -------
    numpy.ndarray
        ``(n,)`` labels in {0, 1}; client 0 is always in part 0.
    """
    from scipy.cluster.hierarchy import linkage as build_tree
    from scipy.cluster.hierarchy import to_tree
    from scipy.spatial.distance import squareform

    check_choice(linkage, "linkage", LINKAGES)
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] < 2:
        raise ValueError(f"similarity must be a square matrix of at least 2 x 2, got shape {s.shape}")
    if not np.isfinite(s).all():
        raise ValueError("similarity holds NaN or Inf")
    d = np.clip(1.0 - (s + s.T) / 2.0, 0.0, None)
    np.fill_diagonal(d, 0.0)
    root = to_tree(build_tree(squareform(d, checks=False), method=linkage))
    labels = np.zeros(s.shape[0], dtype=np.int64)
    labels[root.get_right().pre_order()] = 1
    return labels if labels[0] == 0 else 1 - labels


def max_cross_similarity(similarity: np.ndarray, labels: np.ndarray) -> float:
    """``max_{i in part 0, j in part 1} S[i, j]`` (Sattler's ``alpha_cross_max``)."""
    lab = np.asarray(labels)
    a, b = np.nonzero(lab == 0)[0], np.nonzero(lab == 1)[0]
    if not len(a) or not len(b):
        raise ValueError("labels must name two non-empty parts")
    return float(np.asarray(similarity, dtype=np.float64)[np.ix_(a, b)].max())


def _usable(u: Update, reference: Weights) -> str | None:
    """Why ``u`` cannot be compared with the others (None: it can)."""
    for name, ref in reference.items():
        r = np.asarray(ref)
        if not np.issubdtype(r.dtype, np.floating):
            continue
        if name not in u.weights:
            return f"it has no tensor {name!r}"
        v = np.asarray(u.weights[name])
        if v.shape != r.shape:
            return f"tensor {name!r} has shape {v.shape}, expected {r.shape}"
        if not np.isfinite(v).all():
            return f"tensor {name!r} holds NaN or Inf"
    return None


class CFL(ClusteredFedAvg):
    """Clustered Federated Learning: FedAvg per cluster, recursive bipartitions by update similarity.

    Parameters
    ----------
    eps1 : float
        A cluster may split only when the norm of its clients' mean update
        (weighted by sample counts) is below ``eps1``. Finite, > 0, <= eps2.
    eps2 : float
        ... and its largest client-update norm is above ``eps2``. Finite, > 0.
        Both depend on the model, the optimiser and the learning rate: tune
        them from :attr:`last_norms_`.
    warmup_rounds : int
        First round whose updates may split a cluster (>= 1; FL-bench: 20).
    min_cluster_size : int
        Each child of a split must hold at least this many clients that sent
        an update in the splitting round (>= 1, and twice it at most the
        number of clients).
    max_clusters : int, optional
        No split once there are this many clusters (None: no bound).
    gamma_max : float, optional
        Sattler's acceptance test: a bipartition is kept only if
        ``gamma_max < sqrt((1 - alpha_cross_max) / 2)``, where
        ``alpha_cross_max`` is the largest cosine similarity across the two
        parts (that is, ``alpha_cross_max < 1 - 2 gamma_max**2``). In [0, 1);
        None: no test (the authors' code).
    linkage : {"complete", "single"}
        Of the bipartition (:func:`optimal_bipartition`).
    shared_prefixes, settings, fraction, seed
        As for :class:`~server_kit.strategies.clustered.ClusteredFedAvg`; ``fraction`` of
        each cluster trains per round (1.0: all, so every client can be
        placed by its own update).

    Attributes
    ----------
    split_history_ : list of dict
        One entry per split: ``round``, ``parent`` and ``children`` (cluster
        indices), ``sizes`` (clients of each child, members without an
        update included), ``mean_norm``, ``max_norm``, ``cross_similarity``.
    last_norms_ : dict of str to dict
        Per model key that received usable updates in the latest round (the
        keys as dispatched, a split parent included): ``round``, ``updates``,
        ``mean_norm``, ``max_norm``, ``cross_similarity`` (when a bipartition
        was computed) and ``decision`` (``"split"``,
        ``"warmup"``, ``"max-clusters"``, ``"too-few-updates"``,
        ``"mean-above-eps1"``, ``"max-below-eps2"``, ``"child-too-small"`` or
        ``"gamma"``).
    """

    name = "cfl"
    capabilities = Capabilities(
        refuses_compression=("it splits clusters by the cosine similarities of the devices' whole model "
                             "updates; compressed updates would change its splits"),
        refuses_partials="it splits clusters by the similarities of each device's update; a partial sum mixes them")

    def __init__(self, *, eps1: float = 0.4, eps2: float = 1.6, warmup_rounds: int = 20, min_cluster_size: int = 2,
                 max_clusters: int | None = None, gamma_max: float | None = None, linkage: str = "complete",
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.eps1 = check_number(eps1, "eps1", low=0.0, low_open=True)
        self.eps2 = check_number(eps2, "eps2", low=0.0, low_open=True)
        if self.eps1 > self.eps2:
            raise ValueError(f"eps1 must be <= eps2 (the mean update is never longer than the longest one), "
                             f"got eps1={eps1!r} > eps2={eps2!r}")
        self.warmup_rounds = check_int(warmup_rounds, "warmup_rounds")
        self.min_cluster_size = check_int(min_cluster_size, "min_cluster_size")
        self.max_clusters = None if max_clusters is None else check_int(max_clusters, "max_clusters")
        self.gamma_max = None if gamma_max is None else check_number(gamma_max, "gamma_max", low=0.0)
        if self.gamma_max is not None and self.gamma_max >= 1.0:
            raise ValueError(f"gamma_max must be in [0, 1) or None, got {gamma_max!r}")
        check_choice(linkage, "linkage", LINKAGES)
        self.linkage = linkage
        self.split_history_: list[dict[str, Any]] = []
        self.last_norms_: dict[str, dict[str, Any]] = {}
        self._next_cluster = 1

    # -- lifecycle ---------------------------------------------------------------
    def setup(self, clients: Sequence[ClientInfo], template: Weights) -> None:
        """Register the clients, all in one cluster ``c0``."""
        n = len(clients)
        if 2 * self.min_cluster_size > n:
            raise ValueError(f"min_cluster_size={self.min_cluster_size} leaves no split possible among {n} "
                             f"clients (each of the two children needs {self.min_cluster_size}); "
                             f"it must be at most {n // 2}")
        super().setup(clients, template)
        self.assignment = {}
        self.set_assignment({c.cid: 0 for c in clients})
        self.split_history_ = []
        self.last_norms_ = {}
        self._next_cluster = 1

    def assign_late(self, cid: str, sketch: Any = None, info: ClientInfo | None = None) -> str:
        """A client unknown so far joins the largest cluster (ties: the lowest index)."""
        if info is not None:
            self.clients[cid] = info
        if cid in self.assignment:
            return self.key(self.assignment[cid])
        ks, counts = np.unique(list(self.assignment.values()), return_counts=True)
        k = int(ks[np.argmax(counts)])
        self.assignment[cid] = k
        log.info("cfl: late client %s joins the largest cluster %d", cid, k)
        return self.key(k)

    # -- one round -----------------------------------------------------------------
    def _combine(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        """Test every cluster for a split on its updates, then FedAvg over the (new) clusters."""
        self.last_norms_ = {}
        by_key: dict[str, list[Update]] = {}
        for u in updates:
            ref = self.models.get(u.model_key)
            if ref is None:
                log.warning("cfl round %d: update of %s names unknown model %r; ignored", rnd, u.cid, u.model_key)
                continue
            why = _usable(u, ref)
            if why is not None:
                log.warning("cfl round %d: update of %s for %s not used (%s)", rnd, u.cid, u.model_key, why)
                continue
            by_key.setdefault(u.model_key, []).append(u)
        remap: dict[str, str] = {}  # cid -> child key, for the updates of split clusters
        splits = []
        for key in sorted(by_key, key=lambda k: int(k[1:])):
            usable = sorted(by_key[key], key=lambda u: u.cid)
            children = self._consider(rnd, key, usable)
            if children is not None:
                splits.append(self.split_history_[-1])
                for u, child in zip(usable, children):
                    remap[u.cid] = child
        if remap:
            updates = [dataclasses.replace(u, model_key=remap[u.cid]) if u.cid in remap else u for u in updates]
        summary = super()._combine(rnd, updates)
        summary["clusters"] = len(set(self.assignment.values()))
        summary["norms"] = {k: {"mean": v["mean_norm"], "max": v["max_norm"], "decision": v["decision"]}
                            for k, v in self.last_norms_.items()}
        if splits:
            summary["splits"] = [{"parent": s["parent"], "children": s["children"]} for s in splits]
        return summary

    def _consider(self, rnd: int, key: str, usable: list[Update]) -> list[str] | None:
        """Split cluster ``key`` if its updates say so; returns the child key of each update, or None."""
        ref = self.models[key]
        norms, mean_norm = update_norm_stats([u.weights for u in usable], ref, [u.n_samples for u in usable])
        max_norm = float(norms.max())
        rec: dict[str, Any] = {"round": rnd, "updates": len(usable), "mean_norm": mean_norm, "max_norm": max_norm}
        self.last_norms_[key] = rec
        n_clusters = len(set(self.assignment.values()))
        if rnd < self.warmup_rounds:
            rec["decision"] = "warmup"
        elif self.max_clusters is not None and n_clusters >= self.max_clusters:
            rec["decision"] = "max-clusters"
        elif len(usable) < 2 * self.min_cluster_size:
            rec["decision"] = "too-few-updates"
        elif not mean_norm < self.eps1:
            rec["decision"] = "mean-above-eps1"
        elif not max_norm > self.eps2:
            rec["decision"] = "max-below-eps2"
        else:
            rec["decision"] = None
        log.debug("cfl round %d, %s: %d updates, mean norm %.4g, max norm %.4g: %s", rnd, key, len(usable),
                  mean_norm, max_norm, rec["decision"] or "testing a split")
        if rec["decision"] is not None:
            return None
        gram = delta_gram([u.weights for u in usable], ref)
        sim = 1.0 - cosine_distances_from_gram(gram)
        labels = optimal_bipartition(sim, self.linkage)
        cross = max_cross_similarity(sim, labels)
        rec["cross_similarity"] = cross
        sizes = np.bincount(labels, minlength=2)
        if sizes.min() < self.min_cluster_size:
            rec["decision"] = "child-too-small"
            log.info("cfl round %d: %s not split, a child would have %d < %d clients (sizes %s)", rnd, key,
                     int(sizes.min()), self.min_cluster_size, sizes.tolist())
            return None
        if self.gamma_max is not None and not self.gamma_max < math.sqrt(max(1.0 - cross, 0.0) / 2.0):
            rec["decision"] = "gamma"
            log.info("cfl round %d: %s not split, cross similarity %.4f >= %.4f (gamma_max %.3g)", rnd, key,
                     cross, 1.0 - 2.0 * self.gamma_max ** 2, self.gamma_max)
            return None
        rec["decision"] = "split"
        return self._split(rnd, key, usable, labels, mean_norm, max_norm, cross)

    def _split(self, rnd: int, key: str, usable: list[Update], labels: np.ndarray, mean_norm: float,
               max_norm: float, cross: float) -> list[str]:
        parent = int(key[1:])
        kids = [self._next_cluster, self._next_cluster + 1]
        self._next_cluster += 2
        for u, lab in zip(usable, labels):
            self.assignment[u.cid] = kids[int(lab)]
        sizes = [int((labels == 0).sum()), int((labels == 1).sum())]
        larger = 0 if sizes[0] >= sizes[1] else 1
        for cid in sorted(c for c, k in self.assignment.items() if k == parent):
            self.assignment[cid] = kids[larger]
            sizes[larger] += 1
            log.warning("cfl round %d: client %s of cluster %d sent no usable update; it joins the larger "
                        "child %d", rnd, cid, parent, kids[larger])
        ref = self.models.pop(key)
        for k in kids:
            self.models[self.key(k)] = copy_weights(ref)
        self.split_history_.append({"round": int(rnd), "parent": parent, "children": kids, "sizes": sizes,
                                    "mean_norm": float(mean_norm), "max_norm": float(max_norm),
                                    "cross_similarity": float(cross)})
        log.info("cfl round %d: cluster %d split into %d and %d (sizes %s; mean norm %.4g < %.4g, max norm "
                 "%.4g > %.4g, cross similarity %.4f)", rnd, parent, kids[0], kids[1], sizes, mean_norm,
                 self.eps1, max_norm, self.eps2, cross)
        return [self.key(kids[int(lab)]) for lab in labels]

    # -- checkpoints -----------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["split_history"] = [dict(s) for s in self.split_history_]
        meta["next_cluster"] = self._next_cluster
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        super().load_state(meta, tensors)
        self.split_history_ = [dict(s) for s in meta.get("split_history", [])]
        used = [int(k[1:]) for k in self.models if k.startswith("c") and k[1:].isdigit()]
        used += list(self.assignment.values()) + [k for s in self.split_history_ for k in s["children"]]
        self._next_cluster = max(int(meta.get("next_cluster", 1)), max(used, default=0) + 1)
        self.last_norms_ = {}
