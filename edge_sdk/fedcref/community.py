"""What a FedCRef device does with community models: FedAvg rounds, the community check, refinement.

:class:`CommunityPhases` holds phases 3, 3b and 4 of :class:`~edge_sdk.fedcref.FedCRefClient`
(which inherits them); the state they read and change (labels, cluster models and their
versions, the error table) is the client's, set up in :mod:`.client`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from ..training.torch_support import using_threads
from .association import check_homes, community_check_matrix, node_key
from .clustering import candidate_groups, hungarian_accuracy, refine_candidates
from .errors import ErrorTable
from .models import import_torch, split_models, train_cluster_ae

__all__ = ["CommunityPhases", "Payload"]

log = logging.getLogger(__name__)

#: Every exchanged object: a JSON-able ``meta`` dict and a dict of numpy arrays.
Payload = tuple[dict[str, Any], dict[str, np.ndarray]]


class CommunityPhases:
    """Phases 3 (community FedAvg), 3b (community check) and 4 (refinement) of a FedCRef device.

    A mixin of :class:`~edge_sdk.fedcref.FedCRefClient`: the attributes below and the helpers
    ``_check_ready``, ``_node_errors``, ``_new_version`` and ``_set_labels`` are the client's.
    """

    cid: str
    x: np.ndarray
    architecture: str
    alpha: float
    normalization: str
    lr: float
    batch_size: int
    community_epochs: int
    link_communities: bool
    seed: int
    threads: Optional[int]
    n_clusters_: int
    stability_: Optional[float]
    train_seconds_: float
    models_: dict[int, dict[str, np.ndarray]]
    error_table_: ErrorTable
    _own_versions: dict[int, str]
    _defining: dict[int, dict[str, np.ndarray]]
    _ext: dict[str, tuple[str, dict[str, np.ndarray]]]
    _adopted: bool

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
        torch = import_torch()
        t0 = time.perf_counter()
        with using_threads(torch, self.threads):
            weights, _ = train_cluster_ae(
                self.architecture, tensors, self.x[mask], epochs=self.community_epochs, lr=self.lr,
                batch_size=self.batch_size, seed=self.seed * 7919 + it * 131 + g * 17 + rnd + 1_000_003,
            )
        self.train_seconds_ += time.perf_counter() - t0
        out = {"type": "community_update", "cid": self.cid, "community": g, "round": rnd, "n": int(mask.sum())}
        return out, weights

    def community_check(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Payload:
        """Phase 3b: the member clusters test the other community models against their own community's.

        Parameters
        ----------
        meta : mapping
            ``{"type": "community_check", "iteration": t, "communities": [g, ...],
            "members": {"<g>": [node ids of this client]}}``.
        tensors : mapping
            The community models as ``{"<g>/<param>": array}``.

        Returns
        -------
        (dict, dict)
            ``meta`` = ``{"type": "community_check", "cid", "iteration",
            "clusters": [node ids], "groups": ["<g>", ...]}`` and ``{"stat":
            float32 (clusters, groups)}`` (:func:`community_check_matrix`).
        """
        labels, comm, it = self._check_ready(), split_models(tensors), int(meta.get("iteration", 0))
        home = check_homes(self.cid, meta.get("members", {}))
        errors = {str(g): self.error_table_.of(f"community:{g}", f"check:{it}.{g}", comm[str(g)])
                  for g in meta["communities"]}
        stat, nodes = community_check_matrix(self.cid, labels, home, errors, self.alpha, self.normalization)
        return ({"type": "community_check", "cid": self.cid, "iteration": it, "groups": sorted(errors),
                 "clusters": nodes}, {"stat": stat})

    # ------------------------------------------------------------------ phase 4: refinement

    def refine(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Payload:
        """Algorithm 2 over the own models and the received community models.

        Each own and each community model is a candidate of
        :func:`refine_labels`; with ``link_communities`` an own cluster's
        model and its communities' models form one candidate (the lowest of
        their errors), as separate candidates they would split one category.

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
        err = self._candidate_errors(own, gs, versions, comm)
        groups = candidate_groups(self.cid, own, gs, meta.get("members", {}) if self.link_communities else {})
        new, cols, chosen = refine_candidates(err, groups, self.n_clusters_)
        self.stability_ = hungarian_accuracy(labels, new)
        described = self._adopt(own, cols, chosen, columns, err, comm)
        if len(chosen) < self.n_clusters_:
            log.info("client %s: refinement formed %d of %d clusters", self.cid, len(chosen), self.n_clusters_)
        self._set_labels(new)
        out = {"type": "refined", "cid": self.cid, "iteration": it, "stability": float(self.stability_),
               "n_clusters": self.n_clusters_, "selected": described}
        return out, {}

    def _candidate_errors(self, own: Sequence[int], gs: Sequence[int], versions: Sequence[str],
                          comm: Mapping[str, Mapping[str, np.ndarray]]) -> np.ndarray:
        """Errors on all local samples of the own models, then of the community models, one column each."""
        errs = [self._node_errors(node_key(self.cid, q)) for q in own]
        for g, v in zip(gs, versions):
            if str(g) not in comm:
                raise ValueError(f"client {self.cid}: community model {g} is missing")
            errs.append(self.error_table_.of(f"community:{g}", f"community:{v}", comm[str(g)]))
        return np.stack(errs, axis=1)

    def _adopt(self, own: Sequence[int], cols: Sequence[int], chosen: Sequence[Sequence[int]],
               columns: Sequence[tuple[str, int]], err: np.ndarray,
               comm: Mapping[str, Mapping[str, np.ndarray]]) -> list[dict[str, Any]]:
        """Make column ``cols[p]`` (of candidate ``chosen[p]``) the model of new cluster ``p``; describe each."""
        models: dict[int, dict[str, np.ndarray]] = {}
        own_versions: dict[int, str] = {}
        described = []
        for q in own:
            self.error_table_.drop(f"own:{q}")
        for p, (col, grp) in enumerate(zip(cols, chosen)):
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
            self.error_table_.put(f"own:{p}", own_versions[p], err[:, col])
        self.models_ = models
        self._own_versions = own_versions
        self._defining = dict(models)
        self._adopted = any(d["kind"] == "community" for d in described)
        return described
