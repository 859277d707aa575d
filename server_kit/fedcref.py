"""FedCRef on the server: association graph, communities, FedAvg per community, stopping.

FedCRef (Nardi, Valerio and Passarella) clusters unlabelled data spread over
devices that each hold a few of many unknown categories. The device's side is
:mod:`edge_sdk.fedcref` (:class:`~edge_sdk.fedcref.FedCRefClient`); this
module holds the coordinator and an in-process driver:

* :class:`FedCRefServer` relays the clients' cluster autoencoders (all-to-all
  exchange through the broker: each device may read only what the server
  republishes, so the ACL holds), collects each client's side of the
  association test, builds the association graph (an edge where both sides
  are at most ``theta``), takes its connected components of at least two
  clusters as communities, trains one autoencoder per community by FedAvg
  (:func:`server_kit.aggregate.fedavg`) for ``community_rounds`` rounds,
  sends the community models to the active clients for refinement, removes
  the clients whose clustering is stable (agreement at least ``tau``) from
  the active set, and stops when no client is active, when the numbers of
  communities and isolated clusters stay within 10% over 3 iterations, or
  after ``max_iterations``.
* :func:`run_fedcref` runs a whole federation in one process, every object
  passing through the real wire encoding (:func:`edge_sdk.protocol.encode_message`
  with :func:`~edge_sdk.protocol.tensors_body`, decoded back with
  :func:`~edge_sdk.protocol.decode_message` and
  :func:`~edge_sdk.protocol.parse_tensors`), so the bytes are counted
  exactly, chunk envelopes included.
* :func:`export_communities` writes the community autoencoders to ONNX
  (they output reconstructions); a device labels new data with them through
  :class:`edge_sdk.fedcref.OnnxCommunityLabeler`, ONNX Runtime alone.

Wiring (what the MQTT layer has to carry; every object is ``(meta, tensors)``,
``meta["type"]`` names it; topics as in :class:`edge_sdk.protocol.Topics`):

==================  ========  ==============================  ===========================
object ``type``     kind      from -> to                      topic
==================  ========  ==============================  ===========================
hello               HELLO     client -> server                ``clients/<id>/hello``
iterate             CMD       server -> each client           ``clients/<id>/cmd``
cluster_models      UPDATE    client -> server                ``clients/<id>/update``
cluster_models      MODEL     server -> every other client    ``clients/<id>/cmd`` (relay)
association         FEATURES  client -> server                ``clients/<id>/sketch``
community_model     MODEL     server -> member clients        ``clients/<id>/cmd``
community_update    UPDATE    member client -> server         ``clients/<id>/update``
community_models    MODEL     server -> each active client    ``clients/<id>/cmd``
refined             METRICS   client -> server                ``clients/<id>/metrics``
==================  ========  ==============================  ===========================

Clients only write under their own ``clients/<id>/`` and read their commands
and the cluster models, as the deployed ACL allows: all-to-all exchange goes
through the server. Bytes count one delivery per recipient.

Deviations from the paper, chosen where it is silent: the community model
starts from the model of its largest member cluster; a community round is
``community_epochs`` local epochs on the union of a client's member clusters
(one update per client and community); the community models go to the
active clients only (stable clients do not refine); after refinement a
cluster's model is the one that defined it (own or community), which a
stable client keeps publishing. Two readings are ours and switchable: the
association test scales the error differences relative to the errors
(``normalization="relative"``; ``"minmax"`` is the other reading, see
:func:`edge_sdk.fedcref.association_statistic`), and refinement treats an own
cluster's model and its communities' models as one candidate
(``link_communities=True``; False is Algorithm 2 verbatim, see
:meth:`edge_sdk.fedcref.FedCRefClient.refine`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edge_sdk._validation import check_int
from edge_sdk.fedcref import (
    ARCHITECTURES,
    FedCRefClient,
    check_tau,
    check_theta,
    hungarian_accuracy,
    join_models,
    node_key,
    split_models,
)
from edge_sdk.protocol import (
    SERVER_ID,
    Kind,
    Message,
    ProtocolError,
    decode_message,
    encode_message,
    parse_tensors,
    split_payload,
    tensors_body,
)

from .aggregate import fedavg
from .metrics import CommLedger
from .report import progress_bar

__all__ = [
    "FedCRefResult",
    "FedCRefServer",
    "Wire",
    "association_edges",
    "class_subset_partition",
    "connected_components",
    "export_communities",
    "run_fedcref",
    "stop_rule_met",
    "wrong_associations",
]

log = logging.getLogger(__name__)

Payload = tuple[dict[str, Any], dict[str, np.ndarray]]


# --------------------------------------------------------------------------- pure graph math


def association_edges(stats: Mapping[str, Mapping[str, float]], theta: float) -> list[tuple[str, str]]:
    """Edges of the association graph: pairs whose statistics are at most ``theta`` both ways.

    Parameters
    ----------
    stats : mapping of node -> (mapping of node -> float)
        ``stats[a][b]``: the statistic computed by ``a``'s owner for its cluster
        ``a`` against the model of cluster ``b``. A missing direction means no
        edge.
    theta : float
        Association threshold in (0, 1].

    Returns
    -------
    list of (str, str)
        Sorted pairs ``(a, b)`` with ``a < b``.
    """
    t = check_theta(theta)
    edges = set()
    for a, row in stats.items():
        for b, s in row.items():
            if a == b or not s <= t:
                continue
            back = stats.get(b, {}).get(a)
            if back is not None and back <= t:
                edges.add((a, b) if a < b else (b, a))
    return sorted(edges)


def connected_components(nodes: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[list[str]]:
    """Connected components of an undirected graph (union-find).

    Returns
    -------
    list of list of str
        Each component's nodes sorted; components ordered by their first node.
    """
    parent = {n: n for n in nodes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in edges:
        if a not in parent or b not in parent:
            raise ValueError(f"edge ({a}, {b}) names a node that is not in the graph")
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[str, list[str]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def stop_rule_met(communities: Sequence[int], isolated: Sequence[int], *, tolerance: float = 0.1,
                  patience: int = 3) -> bool:
    """The paper's global stopping rule.

    True when, over the last ``patience`` iterations, neither the number of
    communities nor the number of isolated clusters moved by more than
    ``tolerance`` of its largest value in that window (``max - min <=
    tolerance * max``; a window of zeros is stable).
    """
    if len(communities) != len(isolated):
        raise ValueError("communities and isolated histories differ in length")
    if len(communities) < patience:
        return False
    for series in (communities, isolated):
        w = np.asarray(series[-patience:], dtype=np.float64)
        if w.max() - w.min() > tolerance * w.max():
            return False
    return True


def wrong_associations(edges: Sequence[tuple[str, str]], node_class: Mapping[str, int]) -> int:
    """Edges joining clusters whose majority true classes differ (evaluation only)."""
    return int(sum(node_class[a] != node_class[b] for a, b in edges))


def class_subset_partition(
    labels: Any,
    n_clients: int,
    *,
    classes_per_client: tuple[int, int] = (2, 5),
    samples_per_class: int = 500,
    seed: int = 0,
    max_tries: int = 1000,
) -> list[tuple[np.ndarray, tuple[int, ...]]]:
    """The paper's federation: each client holds a few random classes, ``S`` samples of each, no overlap.

    Client ``i`` draws ``K_i`` uniformly in ``classes_per_client`` and then
    ``K_i`` distinct classes uniformly; it receives ``samples_per_class``
    samples of each, drawn without replacement from a shared pool, so no
    sample goes to two clients. Draws of class sets that need more samples of
    a class than exist are rejected and redrawn (at most ``max_tries``).

    Returns
    -------
    list of (index array, class tuple)
        Per client the indices into ``labels`` (class by class) and its classes.
    """
    y = np.asarray(labels).ravel()
    n = int(n_clients)
    lo, hi = (int(k) for k in classes_per_client)
    classes, counts = np.unique(y, return_counts=True)
    if n < 1 or lo < 1 or hi < lo or hi > len(classes):
        raise ValueError(
            f"need n_clients >= 1 and 1 <= classes_per_client[0] <= [1] <= {len(classes)} classes, "
            f"got {n_clients} and {classes_per_client}"
        )
    spc = int(samples_per_class)
    if spc < 1:
        raise ValueError(f"samples_per_class must be positive, got {samples_per_class}")
    rng = np.random.default_rng(seed)
    avail = dict(zip(classes.tolist(), counts.tolist()))
    for _ in range(int(max_tries)):
        sets = [tuple(sorted(rng.choice(classes, size=int(rng.integers(lo, hi + 1)), replace=False).tolist()))
                for _ in range(n)]
        holders: dict[int, int] = {}
        for s in sets:
            for c in s:
                holders[c] = holders.get(c, 0) + 1
        if all(holders[c] * spc <= avail[c] for c in holders):
            break
    else:
        raise ValueError(f"no draw of class sets fits {spc} samples per class in {max_tries} tries")
    pools = {c: rng.permutation(np.flatnonzero(y == c)).tolist() for c in holders}
    out = []
    for s in sets:
        idx = []
        for c in s:
            idx.extend(pools[c][:spc])
            del pools[c][:spc]
        out.append((np.asarray(idx, dtype=np.int64), s))
    return out


# --------------------------------------------------------------------------- the wire


class Wire:
    """Encode every exchanged object as a FedSketch envelope, count it, decode it back.

    Parameters
    ----------
    federation : str
        Federation id written in the envelopes.
    max_payload : int
        Largest MQTT payload; bigger envelopes are counted as their CHUNK
        envelopes (:func:`edge_sdk.protocol.split_payload`), as a broker with
        a 1 MB packet limit needs.

    Attributes
    ----------
    ledger : server_kit.metrics.CommLedger
        Bytes and messages per object type and direction ("up": client to
        broker, "down": broker to a client, one delivery per recipient).
    """

    def __init__(self, federation: str = "fedcref", max_payload: int = 1_000_000) -> None:
        self.federation = federation
        self.max_payload = int(max_payload)
        self.ledger = CommLedger()

    def send(self, kind: Kind, payload: Payload, *, sender: str, direction: str, recipients: int = 1,
             round: int = 0) -> Payload:
        """Encode ``payload``, count ``recipients`` deliveries, return the decoded copy."""
        meta, tensors = payload
        body = tensors_body(tensors) if tensors else b""
        raw = encode_message(Message(kind, self.federation, sender, int(round), dict(meta), body))
        if len(raw) <= self.max_payload:
            nbytes = len(raw)
        else:
            nbytes = sum(map(len, split_payload(raw, max_payload=self.max_payload, federation=self.federation,
                                                sender=sender, round=int(round))))
        if recipients > 0:
            self.ledger.add(str(meta.get("type", kind.name.lower())), direction, nbytes, recipients)
        msg = decode_message(raw, expected_sender=sender, expected_federation=self.federation)
        return dict(msg.meta), (parse_tensors(msg.body) if msg.body else {})


# --------------------------------------------------------------------------- the coordinator


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
    update from every member client; the ``|G|`` community models go to each
    active client. Clients: see :class:`edge_sdk.fedcref.FedCRefClient`.
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
        stat = np.asarray(tensors.get("stat"), dtype=np.float64) if own and ext else np.zeros((len(own), 0))
        if stat.shape != (len(own), len(ext)):
            raise ValueError(f"client {cid}: statistics of shape {stat.shape}, expected {(len(own), len(ext))}")
        if any(k.rsplit(":", 1)[0] != cid for k in own):
            raise ValueError(f"client {cid} reported statistics for clusters it does not own")
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


# --------------------------------------------------------------------------- ONNX export


def export_communities(
    community_models: Mapping[int, Mapping[str, np.ndarray]],
    architecture: str,
    out_dir: str | os.PathLike[str],
    *,
    members: Optional[Mapping[int, Sequence[str]]] = None,
    metadata: Optional[Mapping[str, Any]] = None,
) -> list[Path]:
    """Export community autoencoders to ONNX (output: the reconstruction) with an index.

    Writes ``community_<g>.onnx`` (input ``x`` ``(batch, d)``, output
    ``x_hat``, dynamic batch, checked against torch with ONNX Runtime to
    1e-5) for every community and ``communities.json`` listing file, sha256,
    community id and member clusters. :class:`edge_sdk.fedcref.OnnxCommunityLabeler`
    reads that folder.

    Returns
    -------
    list of pathlib.Path
        The ONNX files in community order.
    """
    import torch

    from edge_sdk.artifacts import sha256_file
    from edge_sdk.fedcref import build_cluster_ae

    from .export import OPSET, export_onnx, verify_onnx

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    if not community_models:
        raise ValueError("no community models to export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = ARCHITECTURES[architecture][0]
    entries, paths = [], []
    for g in sorted(community_models):
        model = build_cluster_ae(architecture)
        model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32))
                               for k, v in community_models[g].items()}, strict=True)
        model.eval()
        path = out / f"community_{int(g):02d}.onnx"
        export_onnx(model, path, (d,), output_name="x_hat")
        verify_onnx(path, model, (d,), output_name="x_hat")
        paths.append(path)
        entries.append({"community": int(g), "file": path.name, "sha256": sha256_file(path),
                        "members": list((members or {}).get(g, [])), "input_name": "x", "output_name": "x_hat",
                        "input_shape": [d], "input_range": [0.0, 1.0]})
    index = {"format_version": 1, "architecture": architecture, "opset": OPSET,
             "rule": "label = community whose autoencoder has the lowest mean squared reconstruction error",
             "communities": entries, **dict(metadata or {})}
    (out / "communities.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


# --------------------------------------------------------------------------- in-process driver


@dataclass
class FedCRefResult:
    """What :func:`run_fedcref` did.

    Attributes
    ----------
    labels : dict of str to numpy.ndarray
        Each client's final (refined) local clustering.
    initial_labels : dict of str to numpy.ndarray
        Each client's initial clustering.
    global_labels : dict of str to numpy.ndarray
        Community (global category) of each sample, -1 where its cluster is
        in no community.
    communities : list of list of str
        The final communities, as the clients' final clusters: node ids
        ``"<cid>:<cluster>"`` (cluster = final local label) whose samples
        carry that community in ``global_labels``.
    graph_communities : list of list of str
        The communities of the last association graph (clusters as they were
        before the last refinement).
    community_models : dict of int to dict
        The final community autoencoders.
    history : list of dict
        Per iteration: communities, isolated, clusters, edges, active,
        bytes_total, seconds, and with true labels acc (mean per-client
        Hungarian accuracy), client_acc (per client), wrong (wrong edges),
        classes_covered, pure_communities.
    iterations : int
        Iterations run.
    stopped : str
        Why it stopped.
    ledger : server_kit.metrics.CommLedger
        Bytes on the wire per object type and direction.
    seconds : float
        Wall time of the run.
    initial_acc, final_acc : float or None
        Mean per-client Hungarian accuracy against the true labels.
    exported : list of pathlib.Path
        ONNX files written (with ``export_dir``).
    """

    labels: dict[str, np.ndarray]
    initial_labels: dict[str, np.ndarray]
    global_labels: dict[str, np.ndarray]
    communities: list[list[str]]
    graph_communities: list[list[str]]
    community_models: dict[int, dict[str, np.ndarray]]
    history: list[dict[str, Any]]
    iterations: int
    stopped: str
    ledger: CommLedger
    seconds: float
    clusters_start: int = 0
    isolated_first: int = 0
    initial_acc: Optional[float] = None
    final_acc: Optional[float] = None
    wrong_associations: Optional[int] = None
    wrong_association_pct: Optional[float] = None
    exported: list[Path] = field(default_factory=list)

    @property
    def bytes_total(self) -> int:
        """All bytes in and out of the broker."""
        return self.ledger.total()


def _node_classes(clients: Sequence[FedCRefClient], truth: Mapping[str, np.ndarray]) -> dict[str, int]:
    out = {}
    for c in clients:
        y = truth[c.cid]
        for q in range(c.n_clusters_):
            m = c.labels_ == q
            if m.any():
                vals, counts = np.unique(y[m], return_counts=True)
                out[node_key(c.cid, q)] = int(vals[np.argmax(counts)])
    return out


def _mean_acc(clients: Sequence[FedCRefClient], truth: Mapping[str, np.ndarray]) -> float:
    return float(np.mean([hungarian_accuracy(truth[c.cid], c.labels_) for c in clients]))


def run_fedcref(
    clients_data: Any,
    *,
    true_labels: Any = None,
    n_clusters: Any = None,
    init: str = "kmeans",
    dirtiness: float = 0.3,
    encoder: Any = "auto",
    latents: Any = None,
    k_range: Sequence[int] = (2, 5),
    alpha: float = 75.0,
    normalization: str = "relative",
    link_communities: bool = True,
    theta: float = 0.2,
    tau: float = 0.8,
    epochs: int = 20,
    lr: float = 1e-3,
    batch_size: int = 32,
    community_rounds: int = 15,
    community_epochs: int = 1,
    max_iterations: int = 30,
    stop_tolerance: float = 0.1,
    stop_patience: int = 3,
    warm_start: bool = False,
    seed: int = 0,
    threads: Optional[int] = None,
    export_dir: Optional[str | os.PathLike[str]] = None,
    max_payload: int = 1_000_000,
    progress: bool = False,
    callback: Any = None,
) -> FedCRefResult:
    """Run FedCRef on an in-process federation, every object through the wire encoding.

    Parameters
    ----------
    clients_data : sequence or mapping
        Per client its samples ``x`` (arrays in [0, 1]), as a list (ids
        ``c00``, ``c01``...) or a ``{cid: x}`` mapping; or ready
        :class:`~edge_sdk.fedcref.FedCRefClient` objects (then the client
        options below are ignored).
    true_labels : sequence or mapping, optional
        True categories per client, aligned with ``clients_data``: used for
        the scores (and by ``init="dirty"``), never by the algorithm.
    n_clusters : int, sequence or mapping, optional
        ``K_i`` of every client, or per client; None estimates it by
        silhouette (K-means init) or takes the number of true categories
        (dirty init).
    init, dirtiness, encoder, latents, k_range, alpha, normalization, link_communities, epochs, lr, batch_size, community_epochs, warm_start, threads
        Client options (:class:`~edge_sdk.fedcref.FedCRefClient`); ``latents``
        like ``clients_data``.
    theta, tau, community_rounds, max_iterations, stop_tolerance, stop_patience
        Server options (:class:`FedCRefServer`).
    seed : int
        Client ``i`` uses ``seed * 1000 + i``; the autoencoders' common
        initialisation uses ``seed``.
    export_dir : path, optional
        Export the final community models to ONNX there.
    max_payload : int
        Broker message limit for chunk accounting.
    progress : bool
        Show a tqdm bar over iterations.
    callback : callable, optional
        Called as ``callback(record)`` after each iteration.

    Returns
    -------
    FedCRefResult
    """
    t_start = time.perf_counter()
    server = FedCRefServer(theta=theta, tau=tau, community_rounds=community_rounds, max_iterations=max_iterations,
                           stop_tolerance=stop_tolerance, stop_patience=stop_patience)

    def per_client(value: Any, cids: list[str], what: str) -> list[Any]:
        if value is None or isinstance(value, (int, np.integer)):
            return [value] * len(cids)
        if isinstance(value, Mapping):
            return [value[c] for c in cids]
        seq = list(value)
        if len(seq) != len(cids):
            raise ValueError(f"{what} has {len(seq)} entries for {len(cids)} clients")
        return seq

    if isinstance(clients_data, Mapping):
        cids = [str(c) for c in clients_data]
        xs = [clients_data[c] for c in clients_data]
    else:
        xs = list(clients_data)
        cids = [x.cid if isinstance(x, FedCRefClient) else f"c{i:02d}" for i, x in enumerate(xs)]
    if not xs:
        raise ValueError("clients_data holds no client")
    if len(set(cids)) != len(cids):
        raise ValueError("client ids must be unique")
    truth_list = per_client(true_labels, cids, "true_labels") if true_labels is not None else [None] * len(cids)
    if true_labels is not None and any(t is None for t in truth_list):
        raise ValueError("true_labels must give every client's labels")
    ks = per_client(n_clusters, cids, "n_clusters")
    lats = per_client(latents, cids, "latents") if latents is not None else [None] * len(cids)
    clients: list[FedCRefClient] = []
    for i, (cid, x) in enumerate(zip(cids, xs)):
        if isinstance(x, FedCRefClient):
            clients.append(x)
            continue
        clients.append(FedCRefClient(
            cid, x, n_clusters=ks[i], k_range=k_range, init=init, encoder=encoder, latents=lats[i],
            true_labels=truth_list[i], dirtiness=dirtiness, epochs=epochs, lr=lr, batch_size=batch_size,
            community_epochs=community_epochs, alpha=alpha, normalization=normalization,
            link_communities=link_communities, warm_start=warm_start, init_seed=seed,
            seed=seed * 1000 + i, threads=threads,
        ))
    truth = None if true_labels is None else {c.cid: np.asarray(t).ravel() for c, t in zip(clients, truth_list)}
    by_id = {c.cid: c for c in clients}
    wire = Wire(max_payload=max_payload)
    n = len(clients)

    for c in clients:
        meta, _ = wire.send(Kind.HELLO, c.initialize(), sender=c.cid, direction="up")
        server.register(meta)
    initial_labels = {c.cid: c.labels_.copy() for c in clients}
    initial_acc = _mean_acc(clients, truth) if truth else None
    clusters_start = sum(c.n_clusters_ for c in clients)
    isolated_first = None
    bar = progress_bar(max_iterations, "FedCRef iterations", progress)
    while True:
        t_it = time.perf_counter()
        commands = server.begin_iteration()
        it = server.iteration_
        for cid, cmd in commands.items():
            commands[cid], _ = wire.send(Kind.CMD, (cmd, {}), sender=SERVER_ID, direction="down", round=it)
        # phase 1: cluster models, relayed to every other client
        for c in clients:
            up = c.train_models(commands[c.cid])
            if up is None:
                continue
            try:
                meta, tensors = wire.send(Kind.UPDATE, up, sender=c.cid, direction="up", round=it)
            except ProtocolError as e:
                log.warning("cluster models of %s refused (%s); its previous models stay", c.cid, e)
                continue
            relay = server.receive_cluster_models(meta, tensors)
            meta, tensors = wire.send(Kind.MODEL, relay, sender=SERVER_ID, direction="down", recipients=n - 1,
                                      round=it)
            for other in clients:
                if other.cid != c.cid:
                    other.receive_models(meta, tensors)
        # phase 2: association statistics
        node_class = _node_classes(clients, truth) if truth else None
        for c in clients:
            meta, tensors = wire.send(Kind.FEATURES, c.association_report(commands[c.cid]), sender=c.cid,
                                      direction="up", round=it)
            server.receive_association(meta, tensors)
        communities = server.form_communities()
        if isolated_first is None:
            isolated_first = len(server.isolated_)
        # phase 3: one FedAvg model per community
        for g in range(len(communities)):
            weights = server.community_start(g)
            for r in range(1, server.community_rounds + 1):
                updates = []
                for cid, payload in server.community_round(g, r, weights).items():
                    meta, tensors = wire.send(Kind.MODEL, payload, sender=SERVER_ID, direction="down", round=it)
                    up = by_id[cid].community_update(meta, tensors)
                    try:
                        updates.append(wire.send(Kind.UPDATE, up, sender=cid, direction="up", round=it))
                    except ProtocolError as e:  # NaN weights, for one: the receiver refuses them
                        log.warning("community %d round %d: update of %s refused (%s); ignored", g, r, cid, e)
                if updates:
                    weights = server.community_aggregate(g, updates)
            server.set_community_model(g, weights)
        # phase 4: refinement by the active clients
        refining = [c for c in clients if c.cid in server.active_]
        if refining:
            meta, tensors = wire.send(Kind.MODEL, server.community_models_payload(), sender=SERVER_ID,
                                      direction="down", recipients=len(refining), round=it)
            for c in refining:
                report, _ = wire.send(Kind.METRICS, c.refine(meta, tensors), sender=c.cid, direction="up", round=it)
                server.receive_refined(report)
        stop = server.end_iteration()
        record = dict(server.history_[-1])
        record["bytes_total"] = wire.ledger.total()
        record["seconds"] = time.perf_counter() - t_it
        if truth:
            record["client_acc"] = {c.cid: hungarian_accuracy(truth[c.cid], c.labels_) for c in clients}
            record["acc"] = float(np.mean(list(record["client_acc"].values())))
            record["wrong"] = wrong_associations(server.edges_, node_class)
            record["classes_covered"] = len({node_class[c[0]] for c in communities})
            record["pure_communities"] = sum(len({node_class[k] for k in c}) == 1 for c in communities)
        server.history_[-1] = record
        log.info("FedCRef iteration %d: %d communities, %d isolated, %d edges, %d active%s", it,
                 record["communities"], record["isolated"], record["edges"], record["active"],
                 f", acc {record['acc']:.3f}" if truth else "")
        if callback is not None:
            callback(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(comm=record["communities"], iso=record["isolated"], active=record["active"])
        if stop:
            break
    if bar is not None:
        bar.close()

    global_labels = {}
    final_communities: list[list[str]] = [[] for _ in server.communities_]
    for c in clients:
        mapping = server.global_cluster_map(c.cid, c.n_clusters_)
        global_labels[c.cid] = np.asarray(mapping, dtype=np.int64)[c.labels_]
        for p, g in enumerate(mapping):
            if g >= 0:
                final_communities[g].append(node_key(c.cid, p))
    final_communities = [sorted(m) for m in final_communities]
    exported: list[Path] = []
    if export_dir is not None and server.community_models_:
        exported = export_communities(server.community_models_, server._architecture, export_dir,
                                      members=dict(enumerate(final_communities)))
    wrong = server.history_[-1].get("wrong") if truth else None
    edges = server.history_[-1]["edges"]
    return FedCRefResult(
        labels={c.cid: c.labels_.copy() for c in clients},
        initial_labels=initial_labels,
        global_labels=global_labels,
        communities=final_communities,
        graph_communities=[list(c) for c in server.communities_],
        community_models=dict(server.community_models_),
        history=list(server.history_),
        iterations=server.iteration_,
        stopped=str(server.stopped_reason_),
        ledger=wire.ledger,
        seconds=time.perf_counter() - t_start,
        clusters_start=clusters_start,
        isolated_first=int(isolated_first or 0),
        initial_acc=initial_acc,
        final_acc=_mean_acc(clients, truth) if truth else None,
        wrong_associations=wrong,
        wrong_association_pct=(100.0 * wrong / edges if edges else 0.0) if wrong is not None else None,
        exported=exported,
    )
