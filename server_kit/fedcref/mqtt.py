"""FedCRef over MQTT, the server's side: :func:`~server_kit.fedcref.run_fedcref`'s sequence through a broker.

:class:`FedCRefCoordinator` drives a :class:`~server_kit.fedcref.FedCRefServer`
over a transport (:class:`~edge_sdk.transport.MqttTransport`, or the
in-memory twin in tests); the devices run :class:`edge_sdk.fedcref.mqtt.FedCRefEdge`.
Each iteration makes the calls of the in-process driver, in its order:

1. ``iterate`` command to every client on ``clients/<id>/cmd``; each answers
   its ``cluster_models`` (UPDATE on ``clients/<id>/update``, or an
   ``unchanged`` marker), which the server stores and relays at once to every
   other client on that client's own command topic;
2. once every client answered, ``associate`` on each command topic (behind
   the relays on the same topic, so a device has every model before it
   computes its statistics); the ``association`` reports come back as
   FEATURES on ``clients/<id>/sketch``; then the association graph and its
   communities;
3. per community, ``community_rounds`` FedAvg rounds: the model goes to
   each member's command topic (``members`` maps each member client to its
   clusters), the members answer ``community_update``
   on their update topic; updates are averaged in client-id order, as in
   process, so the floats agree;
4. the community check (with ``merge_communities``, two or more
   communities): every community model, with the client's own members, to
   each member client's command topic (``community_check``, MODEL); the
   statistics come back as FEATURES on ``clients/<id>/sketch``; then the
   linked communities merge;
5. the community models go to each active client's command topic; the
   ``refined`` reports come back as METRICS on ``clients/<id>/metrics``;
6. the stopping rule; at the end a ``stop`` command to every client.

Devices write only under their own ``clients/<id>/`` and read their command
topic and broadcasts: the shipped ``deploy/acl`` holds. Every incoming message is checked (kind against topic, sender
against the ``cid`` it claims, iteration, community and round, tensor
names, shapes, dtypes and finiteness); a bad one is logged with its reason
and counted in ``rejected_``, never fatal. A client that does not answer a
phase within ``timeout_s`` (or whose last will says offline) is logged and
treated as gone: it leaves the active set, is no longer waited for nor
commanded, and its last cluster models stay in the graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from edge_sdk.fedcref import initial_ae_weights, node_key, split_models
from edge_sdk.fedcref.client import Payload
from edge_sdk.protocol import (
    SERVER_ID,
    Kind,
    Message,
    ProtocolError,
    Topics,
    parse_tensors,
    tensors_body,
)
from edge_sdk.validation import check_positive

from ..drivers.link import ServerLink
from .server import FedCRefServer

__all__ = ["FedCRefCoordinator", "FedCRefMqttResult", "SERVER_ID"]

log = logging.getLogger(__name__)

#: Message kind and topic leaf each object must arrive with.
_EXPECTED = {
    "hello": (Kind.HELLO, "hello"),
    "cluster_models": (Kind.UPDATE, "update"),
    "association": (Kind.FEATURES, "sketch"),
    "community_update": (Kind.UPDATE, "update"),
    "community_check": (Kind.FEATURES, "sketch"),
    "refined": (Kind.METRICS, "metrics"),
}


@dataclass
class FedCRefMqttResult:
    """What :meth:`FedCRefCoordinator.run` did.

    Attributes
    ----------
    communities : list of list of str
        Final communities as the clients' final clusters (``"<cid>:<q>"``),
        as :attr:`server_kit.fedcref.FedCRefResult.communities`.
    graph_communities : list of list of str
        Communities of the last association graph.
    global_maps : dict of str to list of int
        Per client, the community of each of its final clusters (-1: none).
    history : list of dict
        Per iteration the server's counts (communities, isolated, clusters,
        edges, active, stability) and seconds.
    iterations : int
    stopped : str
    clients : list of str
        Registered clients.
    gone : dict of str to str
        Clients that vanished, and when.
    rejected : dict of str to int
        Refused messages per reason (the coordinator's own checks; the
        transport counts envelope rejections in ``transport["rejected"]``).
    transport : dict
        The server transport's counters.
    seconds : float
    """

    communities: list[list[str]]
    graph_communities: list[list[str]]
    global_maps: dict[str, list[int]]
    history: list[dict[str, Any]]
    iterations: int
    stopped: str
    clients: list[str]
    gone: dict[str, str] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    transport: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class _Reject(Exception):
    """A message the coordinator refuses (reason code, detail)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _explain(msg: Message, error: Exception) -> tuple[str, str]:
    """The reason and detail of refusing ``msg`` whose handling raised ``error`` (FedCRef's wording)."""
    if isinstance(error, _Reject):
        return error.reason, str(error)
    if isinstance(error, (ProtocolError, ValueError, KeyError, TypeError)):
        return getattr(error, "reason", "invalid"), f"{msg.kind.name} {msg.meta.get('type')!r} from {msg.sender}: {error}"
    return "handler-error", (f"{msg.kind.name} {str(msg.meta.get('type'))[:32]!r} from {msg.sender}: "
                             f"{type(error).__name__}: {error}")


class FedCRefCoordinator:
    """Runs a FedCRef federation over MQTT. See the module docstring.

    Parameters
    ----------
    server : FedCRefServer
        The coordinator's state and rules (fresh: no client registered).
    transport : MqttTransport or MemoryTransport
        The server's connection (client id ``"server"``); connected here if
        it is not.
    min_clients : int
        Registration closes as soon as this many clients said hello.
    timeout_s : float
        Longest wait for each phase's answers (and for registration unless
        ``register_timeout_s``).
    register_timeout_s : float, optional
        Longest wait for ``min_clients`` hellos; with fewer the run goes on
        with those that came (at least one), or raises ``RuntimeError``.
    stop_clients : bool
        Send ``stop`` to the clients at the end.
    callback : callable, optional
        ``callback(record)`` after each iteration.

    Attributes
    ----------
    rejected_ : dict of str to int
        Refused messages per reason.
    gone_ : dict of str to str
        Clients treated as vanished, with the phase where they went missing.

    Notes
    -----
    Costs: the server keeps what :class:`~server_kit.fedcref.FedCRefServer`
    keeps (every cluster model, the statistics table, one model per
    community while it trains) plus the community updates of the round in
    hand (one model per member client). Bytes: as the in-process ledger
    (:class:`~server_kit.fedcref.Wire`) counts them (community models go to
    each member on its own command topic, so non-members download none of
    them), plus a few small
    CMD envelopes per client and iteration (``iterate``, ``associate``,
    ``stop``) and an ``unchanged`` marker from a client whose models did not
    change. Clients: as :class:`~edge_sdk.fedcref.FedCRefClient`.
    """

    def __init__(
        self,
        server: FedCRefServer,
        transport: Any,
        *,
        min_clients: int = 2,
        timeout_s: float = 120.0,
        register_timeout_s: Optional[float] = None,
        stop_clients: bool = True,
        callback: Optional[Callable[[dict[str, Any]], None]] = None,
    ) -> None:
        if not isinstance(server, FedCRefServer):
            raise ValueError(f"server must be a FedCRefServer, got {type(server).__name__}")
        if server.clients_:
            raise ValueError("server must be fresh: clients are already registered")
        if isinstance(min_clients, bool) or not isinstance(min_clients, int) or min_clients < 1:
            raise ValueError(f"min_clients must be an integer >= 1, got {min_clients!r}")
        self.server = server
        self.transport = transport
        self.min_clients = min_clients
        self.timeout_s = check_positive(timeout_s, "timeout_s", "number of seconds")
        self.register_timeout_s = (self.timeout_s if register_timeout_s is None
                                   else check_positive(register_timeout_s, "register_timeout_s", "number of seconds"))
        self.stop_clients = bool(stop_clients)
        self.callback = callback
        self.topics: Topics = transport.topics
        self.federation = transport.federation
        self.rejected_: dict[str, int] = {}
        self.gone_: dict[str, str] = {}
        #: The message loop shared with the main job's orchestrator (send, inbox, pump, safe handling).
        self.link = ServerLink(transport, self.topics, self.federation, handler=self._handle,
                               rejections=lambda reason, sender, detail: self._reject(reason, detail),
                               round_of=lambda: self.server.iteration_, explain=_explain)
        self._phase = "idle"
        self._waiting: set[str] = set()
        self._community: tuple[int, int] = (-1, -1)
        self._updates: dict[str, Payload] = {}
        self._spec: Optional[dict[str, tuple[tuple[int, ...], str]]] = None
        self._n_clusters: dict[str, int] = {}

    # ------------------------------------------------------------------ plumbing: the message loop
    # (every message in and out goes through self.link, a ServerLink; _wait and _gone keep who is awaited)

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected_[reason] = self.rejected_.get(reason, 0) + 1
        log.warning("FedCRef: rejected (%s): %s", reason, detail)

    def _publish(self, topic: str, kind: Kind, payload: tuple[Mapping[str, Any], Mapping[str, np.ndarray]]) -> None:
        meta, tensors = payload
        self.link.send(topic, kind, meta=meta, body=tensors_body(tensors) if tensors else b"")

    def _alive(self) -> list[str]:
        return [c for c in sorted(self.server.clients_) if c not in self.gone_]

    def _pump(self, timeout: float) -> bool:
        """Handle messages until nobody is awaited or the deadline; returns whether all answered."""
        return self.link.pump(lambda: not self._waiting, timeout)

    def _wait(self, phase: str, clients: list[str], timeout: float) -> None:
        self._phase = phase
        self._waiting = {c for c in clients if c not in self.gone_}
        if not self._pump(timeout):
            for cid in sorted(self._waiting):
                log.warning("FedCRef: client %s did not answer %s within %g s (iteration %d); treated as gone",
                            cid, phase, timeout, self.server.iteration_)
                self._gone(cid, f"{phase} timeout, iteration {self.server.iteration_}")
        self._waiting = set()

    def _gone(self, cid: str, why: str) -> None:
        self.gone_[cid] = why
        self.server.active_.discard(cid)
        self._waiting.discard(cid)

    # ------------------------------------------------------------------ incoming messages

    def _handle(self, topic: str, msg: Message) -> None:
        parsed = self.topics.parse(topic)
        if parsed is None or parsed[0] != "clients":
            raise _Reject("topic", f"message on unexpected topic {topic}")
        cid, leaf = parsed[1], parsed[2]
        if leaf == "status":
            if msg.meta.get("state") == "offline" and cid in self.server.clients_ and cid not in self.gone_:
                log.warning("FedCRef: client %s went offline (last will); treated as gone", cid)
                self._gone(cid, f"offline in {self._phase}, iteration {self.server.iteration_}")
            return
        m = msg.meta
        what = m.get("type")
        if what not in _EXPECTED:
            raise _Reject("type", f"{msg.kind.name} of unknown type {what!r} from {cid} on {leaf}")
        kind, want_leaf = _EXPECTED[what]
        if msg.kind != kind or leaf != want_leaf:
            raise _Reject("kind", f"{what} from {cid} came as {msg.kind.name} on {leaf}, "
                                  f"expected {kind.name} on {want_leaf}")
        if str(m.get("cid")) != cid or msg.sender != cid:
            raise _Reject("sender", f"{what} on {cid}'s topic claims cid {m.get('cid')!r} (sender {msg.sender!r})")
        if what == "hello":
            self._on_hello(cid, m)
            return
        if cid not in self.server.clients_:
            raise _Reject("unknown-client", f"{what} from unregistered client {cid!r}")
        if cid in self.gone_:
            raise _Reject("gone-client", f"{what} from {cid}, treated as gone ({self.gone_[cid]})")
        it = m.get("iteration")
        if it != self.server.iteration_:
            raise _Reject("stale", f"{what} from {cid} for iteration {it!r} (current {self.server.iteration_})")
        phase_of = {"cluster_models": "models", "association": "associate", "community_update": "community",
                    "community_check": "check", "refined": "refine"}
        if phase_of[what] != self._phase or cid not in self._waiting:
            raise _Reject("unexpected", f"{what} from {cid} in phase {self._phase} "
                                        f"(awaited: {cid in self._waiting})")
        getattr(self, f"_on_{what}")(cid, m, msg.body)
        self._waiting.discard(cid)

    def _on_hello(self, cid: str, m: Mapping[str, Any]) -> None:
        if cid in self.server.clients_:
            log.debug("FedCRef: repeated hello from %s", cid)
            return
        if self._phase != "register":
            raise _Reject("late-hello", f"hello from {cid} after registration closed")
        n = m.get("n_clusters")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise _Reject("hello", f"hello from {cid} has an invalid n_clusters {n!r}")
        self.server.register(m)
        self._n_clusters[cid] = n
        log.info("FedCRef: client %s registered (%s samples, %d clusters)", cid, m.get("n_samples"), n)
        if len(self.server.clients_) >= self.min_clients:
            self._waiting = set()

    def _tensors(self, body: bytes, what: str, cid: str) -> dict[str, np.ndarray]:
        if not body:
            raise _Reject("tensors", f"{what} from {cid} has no tensors")
        return parse_tensors(body)

    def _check_models(self, models: Mapping[str, Mapping[str, np.ndarray]], cid: str) -> None:
        if self._spec is None:  # pragma: no cover - set when registration closes
            raise RuntimeError("no tensor template before registration")
        for q, w in models.items():
            got = {k: (tuple(v.shape), str(v.dtype)) for k, v in w.items()}
            if got != self._spec:
                raise _Reject("tensor-shape", f"model {q} of {cid} does not fit {self.server.architecture}")

    def _on_cluster_models(self, cid: str, m: Mapping[str, Any], body: bytes) -> None:
        if m.get("unchanged") is True and not body:
            return
        if m.get("architecture") != self.server.architecture:
            raise _Reject("architecture", f"cluster models of {cid} are {m.get('architecture')!r}")
        tensors = self._tensors(body, "cluster_models", cid)
        self._check_models(split_models(tensors), cid)
        meta, tensors = self.server.receive_cluster_models(m, tensors)
        for other in self._alive():
            if other != cid:
                self._publish(self.topics.cmd(other), Kind.MODEL, (meta, tensors))

    def _on_association(self, cid: str, m: Mapping[str, Any], body: bytes) -> None:
        tensors = parse_tensors(body) if body else {}
        self.server.receive_association(m, tensors)

    def _on_community_update(self, cid: str, m: Mapping[str, Any], body: bytes) -> None:
        g, r = self._community
        if m.get("community") != g or m.get("round") != r:
            raise _Reject("stale", f"community update of {cid} for community {m.get('community')!r} round "
                                   f"{m.get('round')!r} (current {g}, {r})")
        n = m.get("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise _Reject("meta", f"community update of {cid} has an invalid n {n!r}")
        tensors = self._tensors(body, "community_update", cid)
        self._check_models({"update": tensors}, cid)
        self._updates[cid] = (dict(m), tensors)

    def _on_community_check(self, cid: str, m: Mapping[str, Any], body: bytes) -> None:
        tensors = parse_tensors(body) if body else {}
        try:
            self.server.receive_community_check(m, tensors)
        except (KeyError, TypeError, ValueError) as e:
            raise _Reject("meta", f"community check of {cid}: {e}") from None

    def _on_refined(self, cid: str, m: Mapping[str, Any], body: bytes) -> None:
        s, k = m.get("stability"), m.get("n_clusters")
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise _Reject("meta", f"refinement of {cid} has an invalid stability {s!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not isinstance(m.get("selected"), list) \
                or len(m["selected"]) != k:
            raise _Reject("meta", f"refinement of {cid} has an invalid n_clusters {k!r} or selection")
        self.server.receive_refined(m)
        self._n_clusters[cid] = k

    # ------------------------------------------------------------------ the run

    def _register(self) -> None:
        self._phase = "register"
        self._waiting = {"<quorum>"}  # cleared by the hello that reaches min_clients
        self._publish(self.topics.broadcast(), Kind.CMD, ({"type": "register"}, {}))
        self._pump(self.register_timeout_s)
        self._waiting = set()
        n = len(self.server.clients_)
        if n == 0:
            raise RuntimeError(f"no FedCRef client registered within {self.register_timeout_s:g} s")
        if n < self.min_clients:
            log.warning("FedCRef: only %d of %d clients registered within %g s; going on with them", n,
                        self.min_clients, self.register_timeout_s)
        template = initial_ae_weights(str(self.server.architecture), 0)
        self._spec = {k: (tuple(v.shape), str(v.dtype)) for k, v in template.items()}

    def _community_phase(self, g: int) -> None:
        srv = self.server
        weights = srv.community_start(g)
        for r in range(1, srv.community_rounds + 1):
            payloads = srv.community_round(g, r, weights)
            members = {cid: list(p[0]["members"]) for cid, p in payloads.items()}
            meta = {"type": "community_model", "iteration": srv.iteration_, "community": int(g), "round": int(r),
                    "members": members}
            self._community = (g, r)
            self._updates = {}
            for cid in sorted(members):  # on each member's own topic: non-members download nothing,
                # and a member learns only its own clusters, not who else is in the community
                self._publish(self.topics.cmd(cid), Kind.MODEL, (dict(meta, members={cid: members[cid]}), weights))
            self._wait("community", sorted(members), self.timeout_s)
            updates = [self._updates[c] for c in sorted(self._updates)]  # in-process order: by client id
            if updates:
                try:
                    weights = srv.community_aggregate(g, updates)
                except RuntimeError as e:
                    log.warning("FedCRef: community %d round %d: %s; its model stays", g, r, e)
            else:
                log.warning("FedCRef: community %d round %d: no update; its model stays", g, r)
        srv.set_community_model(g, weights)

    def _iterate(self) -> bool:
        """One iteration, all four phases, each waiting for the answers; returns whether to stop."""
        srv = self.server
        t_it = time.perf_counter()
        commands = srv.begin_iteration()
        it = srv.iteration_
        alive = self._alive()
        # phase 1: cluster models, relayed on arrival
        for cid in alive:
            self._publish(self.topics.cmd(cid), Kind.CMD, (commands[cid], {}))
        self._wait("models", alive, self.timeout_s)
        # phase 2: association statistics (the command follows the relays on the same topic)
        alive = self._alive()
        for cid in alive:
            self._publish(self.topics.cmd(cid), Kind.CMD,
                          ({"type": "associate", "iteration": it, "train": commands[cid]["train"]}, {}))
        self._wait("associate", alive, self.timeout_s)
        communities = srv.form_communities()
        # phase 3: FedAvg per community
        for g in range(len(communities)):
            self._community_phase(g)
        # phase 3b: the community check, then the linked communities merge
        checks = {cid: p for cid, p in srv.community_check_payloads().items() if cid in set(self._alive())}
        if checks:
            for cid, payload in checks.items():
                self._publish(self.topics.cmd(cid), Kind.MODEL, payload)
            self._wait("check", sorted(checks), self.timeout_s)
            srv.merge_checked()
        # phase 4: refinement by the active clients
        refining = [c for c in self._alive() if c in srv.active_]
        if refining:
            payload = srv.community_models_payload()
            for cid in refining:
                self._publish(self.topics.cmd(cid), Kind.MODEL, payload)
            self._wait("refine", refining, self.timeout_s)
        stop = srv.end_iteration() or not self._alive()
        if not self._alive() and srv.stopped_reason_ is None:
            srv.stopped_reason_ = "every client gone"
        record = dict(srv.history_[-1], seconds=time.perf_counter() - t_it, gone=sorted(self.gone_))
        srv.history_[-1] = record
        log.info("FedCRef iteration %d: %d communities (%d links of the community check), %d isolated, %d edges, "
                 "%d active", it, record["communities"], record["community_links"], record["isolated"], record["edges"],
                 record["active"])
        if self.callback is not None:
            self.callback(record)
        return stop

    def run(self) -> FedCRefMqttResult:
        """Register the clients and run iterations until the stopping rule; see the module docstring."""
        t_start = time.perf_counter()
        srv = self.server
        for leaf in ("hello", "update", "sketch", "metrics", "status"):
            self.transport.subscribe(self.topics.all_clients(leaf), self.link.enqueue)
        if not self.transport.is_connected:
            self.transport.connect()
        self._register()
        stop = False
        while not stop:
            stop = self._iterate()
        self._phase = "done"
        if self.stop_clients:
            for cid in self._alive():
                self._publish(self.topics.cmd(cid), Kind.CMD, ({"type": "stop"}, {}))
        global_maps: dict[str, list[int]] = {}
        final: list[list[str]] = [[] for _ in srv.communities_]
        for cid in sorted(srv.clients_):
            mapping = srv.global_cluster_map(cid, self._n_clusters[cid])
            global_maps[cid] = list(mapping)
            for p, g in enumerate(mapping):
                if g >= 0:
                    final[g].append(node_key(cid, p))
        return FedCRefMqttResult(
            communities=[sorted(c) for c in final],
            graph_communities=[list(c) for c in srv.communities_],
            global_maps=global_maps,
            history=list(srv.history_),
            iterations=srv.iteration_,
            stopped=str(srv.stopped_reason_),
            clients=sorted(srv.clients_),
            gone=dict(self.gone_),
            rejected=dict(self.rejected_),
            transport=self.transport.stats(),
            seconds=time.perf_counter() - t_start,
        )
