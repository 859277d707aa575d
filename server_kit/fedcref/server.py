"""The coordinator of a FedCRef federation: :class:`FedCRefServer` (Algorithm 1, server side).

It holds the state and the rules, not the transport: the in-process driver
(:mod:`~server_kit.fedcref.run`) and the MQTT one (:mod:`~server_kit.fedcref.mqtt`)
call its methods in the same order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

from edge_sdk.fedcref import (
    ARCHITECTURES,
    check_tau,
    check_theta,
    join_models,
    node_key,
    split_models,
)
from edge_sdk.fedcref.client import Payload
from edge_sdk.validation import check_int

from ..aggregate import fedavg
from .graph import association_edges, community_links, connected_components, stop_rule_met

__all__ = ["FedCRefServer"]

log = logging.getLogger(__name__)


def _report_matrix(cid: str, tensors: Mapping[str, np.ndarray], rows: Sequence[str], cols: Sequence[str],
                   what: str) -> np.ndarray:
    """A client's ``stat`` matrix (one row per own cluster ``rows``, one column per ``cols``), checked."""
    stat = np.asarray(tensors.get("stat"), dtype=np.float64) if rows and cols else np.zeros((len(rows), 0))
    if stat.shape != (len(rows), len(cols)):
        raise ValueError(f"client {cid}: {what} of shape {stat.shape}, expected {(len(rows), len(cols))}")
    if any(k.rsplit(":", 1)[0] != cid for k in rows):
        raise ValueError(f"client {cid} reported {what} for clusters it does not own")
    return stat


class FedCRefServer:
    """The coordinator of a FedCRef federation (Algorithm 1 of the paper, server side).

    Parameters
    ----------
    theta : float
        Association threshold in (0, 1] (paper: 0.2).
    tau : float
        Stability threshold in (0, 1] (paper: 0.8): a client whose labels
        before and after a refinement agree (Hungarian-matched accuracy) at
        least this much leaves the active set.
    community_rounds : int
        FedAvg rounds per community and iteration (paper: 15).
    max_iterations : int
        Upper bound on iterations.
    stop_tolerance : float
        Relative change allowed by the global stopping rule, in [0, 1)
        (paper: 0.1).
    stop_patience : int
        Iterations the stopping rule looks at (paper: 3).
    min_community_size : int
        Fewest clusters in a community (paper: 2).
    merge_communities : bool
        After each iteration's community training, run the community check
        (:meth:`community_check_payloads`, :meth:`merge_checked`): two
        communities whose models pass the association test against each
        other, on the samples of a majority of each one's members, become
        one. The paper has no such step (False): there a category that the
        cluster-level test splits in two stays two communities.

    Attributes
    ----------
    clients_ : dict
        Hello facts by client id.
    active_ : set of str
        Clients that still train and refine.
    models_ : dict
        Current model of every cluster: node id -> (version, weights, n).
    stats_ : dict
        Association statistics: node -> node -> float.
    edges_, communities_, isolated_ : list
        The last association graph's edges, communities (sorted node lists)
        and isolated nodes.
    community_models_ : dict of int to dict
        The last community models.
    history_ : list of dict
        Per-iteration counts (communities, isolated, edges, active, stability).
    iteration_ : int
        Iterations begun.

    Notes
    -----
    Costs: the server keeps every cluster's current model (``sum_i K_i`` x
    174,840 float32 parameters, 0.7 MB each for 784-100-64-32, about 61 MB
    for the paper's 25 clients with 3.5 clusters each), a ``(sum K_i)^2``
    table of float statistics and one model per community while it trains.
    Bytes per iteration: each client that trained (or whose cluster models
    changed) uploads its ``K_i`` models once and the server relays them to
    the ``N - 1`` others; every client uploads ``K_i x sum_j K_j`` float32
    statistics; each community round sends the model to and receives an
    update from every member client; the community check sends the ``|G|``
    community models to each member client and gets back ``|G|`` float32
    statistics per member cluster; the
    ``|G|`` community models go to each active client. Clients: see :class:`edge_sdk.fedcref.FedCRefClient`.
    """

    def __init__(
        self,
        *,
        theta: float = 0.2,
        tau: float = 0.8,
        community_rounds: int = 15,
        max_iterations: int = 30,
        stop_tolerance: float = 0.1,
        stop_patience: int = 3,
        min_community_size: int = 2,
        merge_communities: bool = True,
    ) -> None:
        self.theta = check_theta(theta)
        self.tau = check_tau(tau)
        self.community_rounds = check_int(community_rounds, "community_rounds", 1)
        self.max_iterations = check_int(max_iterations, "max_iterations", 1)
        if (isinstance(stop_tolerance, bool) or not isinstance(stop_tolerance, (int, float))
                or not 0.0 <= float(stop_tolerance) < 1.0):
            raise ValueError(f"stop_tolerance must be a fraction in [0, 1) (the paper uses 0.1), got {stop_tolerance!r}")
        self.stop_tolerance = float(stop_tolerance)
        self.stop_patience = check_int(stop_patience, "stop_patience", 1)
        self.min_community_size = check_int(min_community_size, "min_community_size", 2)
        if not isinstance(merge_communities, bool):
            raise ValueError(f"merge_communities must be true or false, got {merge_communities!r}")
        self.merge_communities = merge_communities
        self.check_stats_: dict[str, dict[str, float]] = {}
        self.graph_communities_: list[list[str]] = []
        self.community_links_: list[tuple[str, str]] = []
        self.check_groups_: dict[str, list[str]] = {}
        self.clients_: dict[str, dict[str, Any]] = {}
        self.active_: set[str] = set()
        self.models_: dict[str, tuple[str, dict[str, np.ndarray], int]] = {}
        self.stats_: dict[str, dict[str, float]] = {}
        self.edges_: list[tuple[str, str]] = []
        self.communities_: list[list[str]] = []
        self.isolated_: list[str] = []
        self.community_models_: dict[int, dict[str, np.ndarray]] = {}
        self.community_sizes_: dict[int, int] = {}
        self.history_: list[dict[str, Any]] = []
        self.iteration_ = 0
        self.refined_: dict[str, dict[str, Any]] = {}
        self.stopped_reason_: Optional[str] = None
        self._architecture: Optional[str] = None
        self._stability: dict[str, float] = {}

    @property
    def architecture(self) -> Optional[str]:
        """The federation's cluster autoencoder (set by the first hello; None before it)."""
        return self._architecture

    # ------------------------------------------------------------------ registration and commands

    def register(self, meta: Mapping[str, Any]) -> None:
        """Record a client's hello (its id, sample count, cluster count, architecture)."""
        cid = str(meta["cid"])
        arch = str(meta["architecture"])
        if arch not in ARCHITECTURES:
            raise ValueError(f"client {cid} uses unknown architecture {arch!r}")
        if self._architecture is None:
            self._architecture = arch
        elif arch != self._architecture:
            raise ValueError(f"client {cid} uses {arch!r}, the federation {self._architecture!r}")
        self.clients_[cid] = dict(meta)
        self.active_.add(cid)

    def begin_iteration(self) -> dict[str, dict[str, Any]]:
        """Start an iteration; returns the command for each client (``{"iteration", "train"}``)."""
        if not self.clients_:
            raise RuntimeError("no client has registered")
        self.iteration_ += 1
        self._stability = {}
        return {cid: {"type": "iterate", "iteration": self.iteration_, "train": cid in self.active_}
                for cid in sorted(self.clients_)}

    # ------------------------------------------------------------------ phase 1-2: exchange and association

    def receive_cluster_models(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Payload:
        """Store a client's cluster models; returns the relay object for the other clients."""
        cid = str(meta["cid"])
        if cid not in self.clients_:
            raise ValueError(f"cluster models from unregistered client {cid!r}")
        models = split_models(tensors)
        for key in [k for k in self.models_ if k.rsplit(":", 1)[0] == cid]:
            del self.models_[key]
        for c in meta["clusters"]:
            q = str(int(c["q"]))
            if q not in models:
                raise ValueError(f"client {cid} announced cluster {q} without its model")
            self.models_[node_key(cid, int(q))] = (str(c["version"]), models[q], int(c["n"]))
        return dict(meta), dict(tensors)

    def receive_association(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        """Store a client's statistics (its own clusters against every external cluster)."""
        cid = str(meta["cid"])
        own = [str(k) for k in meta["clusters"]]
        ext = [str(k) for k in meta["external"]]
        stat = _report_matrix(cid, tensors, own, ext, "statistics")
        for key in [k for k in self.stats_ if k.rsplit(":", 1)[0] == cid]:
            del self.stats_[key]
        for i, a in enumerate(own):
            self.stats_[a] = {b: float(stat[i, j]) for j, b in enumerate(ext)}

    def form_communities(self) -> list[list[str]]:
        """Association graph -> communities (components with >= ``min_community_size`` clusters)."""
        nodes = sorted(self.models_)
        current = set(nodes)
        stats = {a: {b: s for b, s in row.items() if b in current} for a, row in self.stats_.items() if a in current}
        self.edges_ = association_edges(stats, self.theta)
        comps = connected_components(nodes, self.edges_)
        self.communities_ = [c for c in comps if len(c) >= self.min_community_size]
        self.isolated_ = [c[0] for c in comps if len(c) == 1]
        self.community_models_ = {}
        self.community_sizes_ = {g: sum(self.models_[k][2] for k in c) for g, c in enumerate(self.communities_)}
        self.graph_communities_ = [list(c) for c in self.communities_]
        self.check_stats_ = {}
        self.community_links_ = []
        self.check_groups_ = {}
        return self.communities_

    # ------------------------------------------------------------------ phase 3: community FedAvg

    def community_members(self, g: int) -> dict[str, list[str]]:
        """Member nodes of community ``g`` grouped by client."""
        out: dict[str, list[str]] = {}
        for key in self.communities_[g]:
            out.setdefault(key.rsplit(":", 1)[0], []).append(key)
        return out

    def community_start(self, g: int) -> dict[str, np.ndarray]:
        """Initial model of community ``g``: the model of its largest member cluster."""
        members = self.communities_[g]
        best = min(members, key=lambda k: (-self.models_[k][2], k))
        return dict(self.models_[best][1])

    def community_round(self, g: int, rnd: int, weights: Mapping[str, np.ndarray]) -> dict[str, Payload]:
        """The model message of round ``rnd`` for each member client of community ``g``."""
        return {cid: ({"type": "community_model", "iteration": self.iteration_, "community": int(g),
                       "round": int(rnd), "members": keys}, dict(weights))
                for cid, keys in sorted(self.community_members(g).items())}

    def community_aggregate(self, g: int, updates: Sequence[Payload]) -> dict[str, np.ndarray]:
        """FedAvg of the members' updates (weighted by their sample counts)."""
        good = []
        for meta, w in updates:
            if int(meta["community"]) != g:
                raise ValueError(f"update for community {meta['community']} given to community {g}")
            if not all(np.isfinite(a).all() for a in w.values()):
                log.warning("community %d: update of %s has NaN or Inf; ignored", g, meta.get("cid"))
                continue
            good.append((w, int(meta["n"])))
        if not good:
            raise RuntimeError(f"community {g}: no usable update")
        return fedavg(good)

    def set_community_model(self, g: int, weights: Mapping[str, np.ndarray]) -> None:
        """Record the trained model of community ``g``."""
        self.community_models_[int(g)] = dict(weights)

    def community_models_payload(self) -> Payload:
        """All community models in one object, for refinement."""
        gs = sorted(self.community_models_)
        meta = {"type": "community_models", "iteration": self.iteration_, "communities": gs,
                "versions": [f"{self.iteration_}.{g}" for g in gs],
                "members": {str(g): list(self.communities_[g]) for g in gs}}
        return meta, join_models({str(g): self.community_models_[g] for g in gs})

    # ------------------------------------------------------------------ phase 3b: community check

    def check_groups(self) -> dict[str, list[str]]:
        """The groups of the community check: the members of each trained community, by id ``"<g>"``."""
        return {str(g): list(self.communities_[g]) for g in sorted(self.community_models_)}

    def community_check_payloads(self) -> dict[str, Payload]:
        """The community check's object for each member client: every community model, its own members.

        Empty when the check is off or there are fewer than two trained
        communities. A client learns which of its own clusters are in which
        community, never the other members.
        """
        gs = sorted(self.community_models_)
        if not self.merge_communities or len(gs) < 2:
            return {}
        tensors = join_models({str(g): self.community_models_[g] for g in gs})
        owners: dict[str, dict[str, list[str]]] = {}
        for g in gs:
            for cid, keys in self.community_members(g).items():
                owners.setdefault(cid, {})[str(g)] = keys
        return {cid: ({"type": "community_check", "iteration": self.iteration_, "communities": gs,
                       "members": members}, tensors)
                for cid, members in sorted(owners.items())}

    def receive_community_check(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        """Store a client's community check (its member clusters against every community model)."""
        cid = str(meta["cid"])
        nodes = [str(k) for k in meta["clusters"]]
        groups = [str(g) for g in meta["groups"]]
        stat = _report_matrix(cid, tensors, nodes, groups, "community check statistics")
        unknown = sorted(set(groups) - set(self.check_groups()))
        if unknown:
            raise ValueError(f"client {cid} reported a community check against communities that are not trained: "
                             f"{unknown}")
        if not np.isfinite(stat).all():
            raise ValueError(f"client {cid}: community check has NaN or Inf")
        for i, k in enumerate(nodes):
            self.check_stats_[k] = {g: float(stat[i, j]) for j, g in enumerate(groups)}

    def merge_checked(self) -> list[tuple[str, str]]:
        """Merge the communities linked by the check (:func:`~server_kit.fedcref.graph.community_links`).

        Linked communities become one, with the model of its largest part (by
        samples); communities are renumbered in the order of their first
        node. Returns the links, as community ids of :meth:`check_groups`
        before the merge (kept in :attr:`check_groups_` for the audit).
        """
        groups = self.check_groups()
        self.check_groups_ = groups
        links = community_links(self.check_stats_, groups, self.theta) if self.merge_communities else []
        self.community_links_ = links
        if not links:
            return links
        models, sizes = self.community_models_, self.community_sizes_
        merged = []
        for comp in connected_components(sorted(groups), links):
            parts = [int(g) for g in comp]
            lead = max(parts, key=lambda g: (sizes[g], -g))
            merged.append((sorted(k for g in comp for k in groups[g]), models[lead], sum(sizes[g] for g in parts)))
        merged.sort(key=lambda m: m[0][0])
        log.info("FedCRef iteration %d: the community check linked %d pairs: %d communities became %d",
                 self.iteration_, len(links), len(self.communities_), len(merged))
        self.communities_ = [m[0] for m in merged]
        self.community_models_ = {i: m[1] for i, m in enumerate(merged)}
        self.community_sizes_ = {i: m[2] for i, m in enumerate(merged)}
        return links

    # ------------------------------------------------------------------ phase 4: stability and stopping

    def receive_refined(self, meta: Mapping[str, Any]) -> None:
        """Record a client's refinement report; it leaves the active set when stable."""
        cid = str(meta["cid"])
        s = float(meta["stability"])
        if not math.isfinite(s):
            log.warning("client %s reported a non-finite stability; it stays active", cid)
            return
        self._stability[cid] = s
        self.refined_[cid] = {"iteration": self.iteration_, "selected": list(meta.get("selected", []))}
        if s >= self.tau:
            self.active_.discard(cid)

    def end_iteration(self) -> bool:
        """Record the iteration; True when the federation should stop."""
        self.history_.append({
            "iteration": self.iteration_,
            "communities": len(self.communities_),
            "isolated": len(self.isolated_),
            "clusters": len(self.models_),
            "edges": len(self.edges_),
            "community_links": len(self.community_links_),
            "active": len(self.active_),
            "stability": dict(self._stability),
        })
        if not self.active_:
            self.stopped_reason_ = "no active client"
        elif stop_rule_met([h["communities"] for h in self.history_], [h["isolated"] for h in self.history_],
                           tolerance=self.stop_tolerance, patience=self.stop_patience):
            self.stopped_reason_ = "communities and isolated clusters stable"
        elif self.iteration_ >= self.max_iterations:
            self.stopped_reason_ = "max_iterations"
        else:
            return False
        log.info("FedCRef stops after iteration %d: %s", self.iteration_, self.stopped_reason_)
        return True

    def node_community(self) -> dict[str, int]:
        """Community index of every node of the last graph (-1 for a node in no community)."""
        out = {k: -1 for k in self.models_}
        for g, c in enumerate(self.communities_):
            for k in c:
                out[k] = g
        return out

    def global_cluster_map(self, cid: str, n_clusters: int) -> list[int]:
        """Community of each current cluster of ``cid`` (-1: none), for its final labels.

        A client that refined in the last iteration maps cluster ``p`` through
        the model that defined it (a community model, or its own model whose
        node's community counts); otherwise cluster ``p`` is node ``cid:p`` of
        the last graph.
        """
        comm = self.node_community()
        ref = self.refined_.get(cid)
        if ref is not None and ref["iteration"] == self.iteration_:
            out = []
            for s in ref["selected"]:
                if int(s.get("community", -1)) >= 0:
                    out.append(int(s["community"]))
                elif s["kind"] == "community":
                    out.append(int(s["g"]))
                else:
                    out.append(comm.get(node_key(cid, int(s["q"])), -1))
            return out
        return [comm.get(node_key(cid, p), -1) for p in range(n_clusters)]
