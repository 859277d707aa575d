"""The in-process FedCRef driver: :func:`run_fedcref` runs a whole federation in one process.

Every object passes through the real wire encoding (:class:`~server_kit.fedcref.wire.Wire`),
so the bytes are counted exactly. One iteration makes the calls of the MQTT
coordinator (:mod:`server_kit.fedcref.mqtt`), in its order: cluster models
(relayed to every other client), association statistics and communities,
FedAvg per community, refinement by the active clients, the stopping rule.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edge_sdk.fedcref import FedCRefClient, hungarian_accuracy, node_key
from edge_sdk.protocol import SERVER_ID, Kind, ProtocolError

from ..metrics import CommLedger
from ..report import progress_bar
from .export import export_communities
from .graph import association_audit, wrong_associations, wrong_community_links
from .server import FedCRefServer
from .wire import Wire

__all__ = ["FedCRefResult", "run_fedcref"]

log = logging.getLogger(__name__)


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
        wrong_links (community links joining different classes),
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


def _node_classes(clients: Sequence[FedCRefClient],
                  truth: Mapping[str, np.ndarray]) -> tuple[dict[str, int], dict[str, float]]:
    """Majority true class of every current cluster, and the share of the cluster's samples in it."""
    classes, purity = {}, {}
    for c in clients:
        y = truth[c.cid]
        for q in range(c.n_clusters_):
            m = c.labels_ == q
            if m.any():
                vals, counts = np.unique(y[m], return_counts=True)
                key = node_key(c.cid, q)
                classes[key] = int(vals[np.argmax(counts)])
                purity[key] = float(counts.max() / counts.sum())
    return classes, purity


def _mean_acc(clients: Sequence[FedCRefClient], truth: Mapping[str, np.ndarray]) -> float:
    return float(np.mean([hungarian_accuracy(truth[c.cid], c.labels_) for c in clients]))


def _per_client(value: Any, cids: list[str], what: str) -> list[Any]:
    """``value`` for each client: one value for all, a ``{cid: value}`` mapping or a sequence in client order."""
    if value is None or isinstance(value, (int, np.integer)):
        return [value] * len(cids)
    if isinstance(value, Mapping):
        return [value[c] for c in cids]
    seq = list(value)
    if len(seq) != len(cids):
        raise ValueError(f"{what} has {len(seq)} entries for {len(cids)} clients")
    return seq


def _make_clients(clients_data: Any, true_labels: Any, n_clusters: Any, latents: Any, seed: int,
                  options: Mapping[str, Any]) -> tuple[list[FedCRefClient], Optional[dict[str, np.ndarray]]]:
    """The clients of :func:`run_fedcref` (built from data with ``options``, or given) and their true labels."""
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
    truth_list = _per_client(true_labels, cids, "true_labels") if true_labels is not None else [None] * len(cids)
    if true_labels is not None and any(t is None for t in truth_list):
        raise ValueError("true_labels must give every client's labels")
    ks = _per_client(n_clusters, cids, "n_clusters")
    lats = _per_client(latents, cids, "latents") if latents is not None else [None] * len(cids)
    clients: list[FedCRefClient] = []
    for i, (cid, x) in enumerate(zip(cids, xs)):
        if isinstance(x, FedCRefClient):
            clients.append(x)
            continue
        clients.append(FedCRefClient(cid, x, n_clusters=ks[i], latents=lats[i], true_labels=truth_list[i],
                                     init_seed=seed, seed=seed * 1000 + i, **options))
    truth = None if true_labels is None else {c.cid: np.asarray(t).ravel() for c, t in zip(clients, truth_list)}
    return clients, truth


class _InProcessRun:
    """The federation of :func:`run_fedcref`: a server, its clients and the wire between them, one phase a method."""

    def __init__(self, server: FedCRefServer, clients: list[FedCRefClient],
                 truth: Optional[dict[str, np.ndarray]], wire: Wire) -> None:
        self.server = server
        self.clients = clients
        self.by_id = {c.cid: c for c in clients}
        self.truth = truth
        self.wire = wire
        self.initial_labels: dict[str, np.ndarray] = {}
        self.initial_acc: Optional[float] = None
        self.clusters_start = 0

    def register(self) -> None:
        """Each client computes its initial clustering and says hello; the starting point is recorded."""
        for c in self.clients:
            meta, _ = self.wire.send(Kind.HELLO, c.initialize(), sender=c.cid, direction="up")
            self.server.register(meta)
        self.initial_labels = {c.cid: c.labels_.copy() for c in self.clients}
        self.initial_acc = _mean_acc(self.clients, self.truth) if self.truth else None
        self.clusters_start = sum(c.n_clusters_ for c in self.clients)

    def iterate(self) -> tuple[dict[str, Any], bool]:
        """One iteration, all four phases; returns its history record and whether to stop."""
        wire, server = self.wire, self.server
        t_it = time.perf_counter()
        commands = server.begin_iteration()
        it = server.iteration_
        for cid, cmd in commands.items():
            commands[cid], _ = wire.send(Kind.CMD, (cmd, {}), sender=SERVER_ID, direction="down", round=it)
        self._exchange_models(commands, it)
        nodes = _node_classes(self.clients, self.truth) if self.truth else None
        communities = self._associate(commands, it)
        self._train_communities(len(communities), it)
        self._check_communities(it)
        communities = server.communities_
        self._refine(it)
        stop = server.end_iteration()
        return self._record(communities, nodes, t_it), stop

    def _exchange_models(self, commands: Mapping[str, Mapping[str, Any]], it: int) -> None:
        """Phase 1: cluster models, relayed to every other client."""
        wire, n = self.wire, len(self.clients)
        for c in self.clients:
            up = c.train_models(commands[c.cid])
            if up is None:
                continue
            try:
                meta, tensors = wire.send(Kind.UPDATE, up, sender=c.cid, direction="up", round=it)
            except ProtocolError as e:
                log.warning("cluster models of %s refused (%s); its previous models stay", c.cid, e)
                continue
            relay = self.server.receive_cluster_models(meta, tensors)
            meta, tensors = wire.send(Kind.MODEL, relay, sender=SERVER_ID, direction="down", recipients=n - 1,
                                      round=it)
            for other in self.clients:
                if other.cid != c.cid:
                    other.receive_models(meta, tensors)

    def _associate(self, commands: Mapping[str, Mapping[str, Any]], it: int) -> list[list[str]]:
        """Phase 2: association statistics, then the graph's communities."""
        for c in self.clients:
            meta, tensors = self.wire.send(Kind.FEATURES, c.association_report(commands[c.cid]), sender=c.cid,
                                           direction="up", round=it)
            self.server.receive_association(meta, tensors)
        return self.server.form_communities()

    def _train_communities(self, n_communities: int, it: int) -> None:
        """Phase 3: one FedAvg model per community."""
        wire, server = self.wire, self.server
        for g in range(n_communities):
            weights = server.community_start(g)
            for r in range(1, server.community_rounds + 1):
                updates = []
                for cid, payload in server.community_round(g, r, weights).items():
                    meta, tensors = wire.send(Kind.MODEL, payload, sender=SERVER_ID, direction="down", round=it)
                    up = self.by_id[cid].community_update(meta, tensors)
                    try:
                        updates.append(wire.send(Kind.UPDATE, up, sender=cid, direction="up", round=it))
                    except ProtocolError as e:  # NaN weights, for one: the receiver refuses them
                        log.warning("community %d round %d: update of %s refused (%s); ignored", g, r, cid, e)
                if updates:
                    weights = server.community_aggregate(g, updates)
            server.set_community_model(g, weights)

    def _check_communities(self, it: int) -> None:
        """Phase 3b: the member clients test the community models against each other; linked ones merge."""
        for cid, payload in self.server.community_check_payloads().items():
            meta, tensors = self.wire.send(Kind.MODEL, payload, sender=SERVER_ID, direction="down", round=it)
            report = self.by_id[cid].community_check(meta, tensors)
            self.server.receive_community_check(*self.wire.send(Kind.FEATURES, report, sender=cid, direction="up",
                                                                round=it))
        self.server.merge_checked()

    def _refine(self, it: int) -> None:
        """Phase 4: refinement by the active clients."""
        refining = [c for c in self.clients if c.cid in self.server.active_]
        if refining:
            meta, tensors = self.wire.send(Kind.MODEL, self.server.community_models_payload(), sender=SERVER_ID,
                                           direction="down", recipients=len(refining), round=it)
            for c in refining:
                report, _ = self.wire.send(Kind.METRICS, c.refine(meta, tensors), sender=c.cid, direction="up",
                                           round=it)
                self.server.receive_refined(report)

    def _record(self, communities: list[list[str]], nodes: Optional[tuple[dict[str, int], dict[str, float]]],
                t_it: float) -> dict[str, Any]:
        """The server's history record of the iteration, with bytes, seconds and (with true labels) scores."""
        server, truth, clients = self.server, self.truth, self.clients
        record = dict(server.history_[-1])
        record["bytes_total"] = self.wire.ledger.total()
        record["seconds"] = time.perf_counter() - t_it
        if truth and nodes:
            node_class, purity = nodes
            audit = association_audit(server.stats_, server.theta, node_class, purity, communities)
            record["audit"] = audit.as_dict()
            record["client_acc"] = {c.cid: hungarian_accuracy(truth[c.cid], c.labels_) for c in clients}
            record["acc"] = float(np.mean(list(record["client_acc"].values())))
            record["wrong"] = wrong_associations(server.edges_, node_class)
            record["wrong_links"] = wrong_community_links(server.community_links_, server.check_groups_, node_class)
            record["classes_covered"] = len({node_class[c[0]] for c in communities})
            record["pure_communities"] = sum(len({node_class[k] for k in c}) == 1 for c in communities)
        server.history_[-1] = record
        log.info("FedCRef iteration %d: %d communities (%d links of the community check), %d isolated, %d edges, "
                 "%d active%s", server.iteration_, record["communities"], record["community_links"],
                 record["isolated"], record["edges"], record["active"], f", acc {record['acc']:.3f}" if truth else "")
        return record

    def final_communities(self) -> tuple[dict[str, np.ndarray], list[list[str]]]:
        """Each sample's community (-1: none) per client, and the communities as the clients' final clusters."""
        global_labels = {}
        final_communities: list[list[str]] = [[] for _ in self.server.communities_]
        for c in self.clients:
            mapping = self.server.global_cluster_map(c.cid, c.n_clusters_)
            global_labels[c.cid] = np.asarray(mapping, dtype=np.int64)[c.labels_]
            for p, g in enumerate(mapping):
                if g >= 0:
                    final_communities[g].append(node_key(c.cid, p))
        return global_labels, [sorted(m) for m in final_communities]

    def result(self, export_dir: Optional[str | os.PathLike[str]], t_start: float) -> FedCRefResult:
        """What the run did, after exporting the community models to ``export_dir`` (if given)."""
        server, clients, truth = self.server, self.clients, self.truth
        global_labels, final_communities = self.final_communities()
        exported: list[Path] = []
        if export_dir is not None and server.community_models_:
            exported = export_communities(server.community_models_, server.architecture, export_dir,
                                          members=dict(enumerate(final_communities)))
        last = server.history_[-1]
        wrong = last.get("wrong", 0) + last.get("wrong_links", 0) if truth else None
        edges = last["edges"] + last.get("community_links", 0)
        return FedCRefResult(
            labels={c.cid: c.labels_.copy() for c in clients},
            initial_labels=self.initial_labels,
            global_labels=global_labels,
            communities=final_communities,
            graph_communities=[list(c) for c in server.communities_],
            community_models=dict(server.community_models_),
            history=list(server.history_),
            iterations=server.iteration_,
            stopped=str(server.stopped_reason_),
            ledger=self.wire.ledger,
            seconds=time.perf_counter() - t_start,
            clusters_start=self.clusters_start,
            isolated_first=int(server.history_[0]["isolated"]),  # the first graph's isolated clusters
            initial_acc=self.initial_acc,
            final_acc=_mean_acc(clients, truth) if truth else None,
            wrong_associations=wrong,
            wrong_association_pct=(100.0 * wrong / edges if edges else 0.0) if wrong is not None else None,
            exported=exported,
        )


def _iterate_until_stop(fed: _InProcessRun, max_iterations: int, progress: bool, callback: Any) -> None:
    """Iterations until the server's stopping rule, with an optional tqdm bar and callback."""
    bar = progress_bar(max_iterations, "FedCRef iterations", progress)
    while True:
        record, stop = fed.iterate()
        if callback is not None:
            callback(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(comm=record["communities"], iso=record["isolated"], active=record["active"])
        if stop:
            break
    if bar is not None:
        bar.close()


def run_fedcref(
    clients_data: Any, *, true_labels: Any = None, n_clusters: Any = None, init: str = "kmeans",
    dirtiness: float = 0.3, encoder: Any = "auto", latents: Any = None, k_range: Sequence[int] = (2, 5),
    alpha: float = 75.0, normalization: str = "relative", link_communities: bool = True, own_models: bool = True,
    theta: float = 0.2,
    tau: float = 0.8, epochs: int = 20, lr: float = 1e-3, batch_size: int = 32, community_rounds: int = 15,
    community_epochs: int = 1, max_iterations: int = 30, stop_tolerance: float = 0.1, stop_patience: int = 3,
    merge_communities: bool = True, warm_start: bool = False, seed: int = 0, threads: Optional[int] = None,
    export_dir: Optional[str | os.PathLike[str]] = None, max_payload: int = 1_000_000, progress: bool = False,
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
        silhouette (K-means or Ward init) or takes the number of true categories
        (dirty init).
    init, dirtiness, encoder, latents, k_range, alpha, normalization, link_communities, own_models, epochs, lr, \
    batch_size, community_epochs, warm_start, threads
        Client options (:class:`~edge_sdk.fedcref.FedCRefClient`); ``latents``
        like ``clients_data``.
    theta, tau, community_rounds, max_iterations, stop_tolerance, stop_patience, merge_communities
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
                           stop_tolerance=stop_tolerance, stop_patience=stop_patience,
                           merge_communities=merge_communities)
    options = dict(k_range=k_range, init=init, encoder=encoder, dirtiness=dirtiness, epochs=epochs, lr=lr,
                   batch_size=batch_size, community_epochs=community_epochs, alpha=alpha, normalization=normalization,
                   link_communities=link_communities, own_models=own_models, warm_start=warm_start, threads=threads)
    clients, truth = _make_clients(clients_data, true_labels, n_clusters, latents, seed, options)
    fed = _InProcessRun(server, clients, truth, Wire(max_payload=max_payload))
    fed.register()
    _iterate_until_stop(fed, max_iterations, progress, callback)
    return fed.result(export_dir, t_start)
