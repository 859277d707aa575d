"""NATS in subprocesses: a cluster of ``nats-server`` nodes on free local ports, each with JetStream and MQTT.

NATS speaks MQTT 3.1.1 natively (not MQTT 5); its MQTT needs JetStream (the
sessions, QoS 1 messages and retained messages live in JetStream streams)
and an explicit ``server_name``. :class:`NatsCluster` writes one
configuration per node into a temporary folder (client, cluster, MQTT and
monitoring ports, a JetStream store, optional users and permissions), starts
``nats-server -c`` for each and returns once every node's MQTT port accepts,
every node has its routes to the others and JetStream has a meta leader. It
mirrors :class:`~server_kit.broker.mosquitto.MosquittoBroker`: ``start``,
``stop``, a context manager, ``url`` (here the comma-joined list a
:class:`~edge_sdk.transport.BrokerConfig` accepts) and, per node,
:meth:`~NatsCluster.kill` (SIGKILL) and :meth:`~NatsCluster.restart`.

What NATS 2.9 does differently from Mosquitto (``deploy/README.md``, "A NATS
cluster", has the whole list): no MQTT 5; a topic with ``.`` or a space is
refused before 2.10 (the publisher is disconnected; a subscription gets a
failure SUBACK), and ``*`` and ``>`` inside a topic are NATS wildcards;
``$share/`` subscriptions are granted but receive nothing; ``max_payload`` is
not enforced on MQTT PUBLISH before 2.14; permissions are NATS subjects
(``/`` becomes ``.``), without Mosquitto's ``%u``, and an MQTT user needs
subscribe permission on ``$MQTT.sub.>`` for its QoS 1 subscriptions.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .nats_node import NatsNode, PortTaken, find_nats_server, mqtt_connack, nats_server_version
from .ports import free_ports, wait_port

__all__ = ["NatsCluster", "NatsNode", "find_nats_server", "mqtt_connack", "nats_server_version"]

log = logging.getLogger(__name__)

PORT_TRIES = 3
"""How many sets of ports a first :meth:`NatsCluster.start` tries when another process took one of them."""


def _quote(value: str) -> str:
    """A NATS configuration string, double-quoted (a bare ``$x`` would be a variable)."""
    return json.dumps(str(value))


def _subjects(values: Sequence[str]) -> str:
    return "[" + ", ".join(_quote(v) for v in values) + "]"


class NatsCluster:
    """A private NATS cluster on free local ports, JetStream and an MQTT listener on every node.

    Parameters
    ----------
    nodes : int
        Number of ``nats-server`` processes; more than one are clustered
        (routes between every pair). JetStream replicates the MQTT streams
        on up to three of them, so a three-node cluster survives one lost node.
    host : str
        Address every listener binds.
    users : dict of str to str, optional
        User names and passwords (none: anonymous clients, no permissions).
    permissions : dict of str to dict, optional
        Per user, ``{"publish": [subjects], "subscribe": [subjects]}`` in
        NATS subject syntax (``fedsketch.demo.clients.c1.hello``; ``*`` and
        ``>`` wildcards); a user without an entry may do anything. An MQTT
        user with subscribe permissions also needs ``$MQTT.sub.>`` (its QoS 1
        subscriptions are delivered there): it is added when missing.
    mqtt_only : bool
        Let ``users`` connect over MQTT only (``allowed_connection_types``),
        not as plain NATS clients (which could subscribe to ``$MQTT.sub.>``,
        every MQTT client's QoS 1 deliveries).
    max_payload : int, optional
        NATS's ``max_payload`` (default 1 MB). NATS enforces it on MQTT
        PUBLISH only from 2.14.
    ack_wait_s : float, optional
        The MQTT listener's ``ack_wait`` (NATS's default 30 s): a QoS 1
        message not acknowledged this long is sent again. A device whose node
        died mid-delivery gets its message this long after it failed over.
    extra_conf : str
        More configuration, written at the end of every node's file (an
        ``authorization`` block of ``deploy/nats/make_users.py``, say).
    login : (str, str), optional
        User name and password of the MQTT connection :meth:`start` makes to
        each node before returning (default: the first of ``users``; none:
        anonymous). With users in ``extra_conf`` and no ``login``, that
        check is left out.
    cluster_name : str
        The cluster's name.
    binary : str, optional
        The ``nats-server`` executable (default: :func:`find_nats_server`).
    """

    def __init__(
        self,
        nodes: int = 3,
        *,
        host: str = "127.0.0.1",
        users: Mapping[str, str] | None = None,
        permissions: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
        mqtt_only: bool = True,
        max_payload: int | None = None,
        ack_wait_s: float | None = None,
        extra_conf: str = "",
        login: tuple[str, str] | None = None,
        cluster_name: str = "fedsketch",
        binary: str | None = None,
    ) -> None:
        self.binary = binary or find_nats_server()
        if self.binary is None:
            raise FileNotFoundError("nats-server is not installed (not on PATH nor at /usr/sbin/nats-server)")
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
        if max_payload is not None and (isinstance(max_payload, bool) or int(max_payload) < 1):
            raise ValueError(f"max_payload must be a positive integer, got {max_payload!r}")
        if ack_wait_s is not None and not (isinstance(ack_wait_s, (int, float)) and not isinstance(ack_wait_s, bool)
                                           and 0 < ack_wait_s < float("inf")):
            raise ValueError(f"ack_wait_s must be a positive number of seconds, got {ack_wait_s!r}")
        unknown = sorted(set(permissions or {}) - set(users or {}))
        if unknown:
            raise ValueError(f"permissions name users without a password: {unknown}")
        for user, perms in (permissions or {}).items():
            extra = sorted(set(perms) - {"publish", "subscribe"})
            if extra:
                raise ValueError(f"permissions of {user!r} may name 'publish' and 'subscribe', got {extra}")
        self.n = nodes
        self.host = host
        self.users = dict(users) if users else None
        self.permissions = {u: {k: list(v) for k, v in p.items()} for u, p in (permissions or {}).items()}
        self.mqtt_only = mqtt_only
        self.max_payload = max_payload
        self.ack_wait_s = ack_wait_s
        self.extra_conf = extra_conf
        if login is None and self.users:
            login = next(iter(self.users.items()))
        self.login = login
        self.cluster_name = cluster_name
        self._dir: Path | None = None
        self.nodes: list[NatsNode] = []

    def __repr__(self) -> str:
        alive = sum(node.running for node in self.nodes)
        return f"NatsCluster(nodes={self.n}, running={alive}, url={self.url!r})"

    # -- addresses ---------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        """Each node's ``mqtt://host:port`` (empty before the first start)."""
        return [node.mqtt_url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's MQTT URL, comma-joined: a device's broker list (``BrokerConfig(url=...)``)."""
        return ",".join(self.urls)

    def urls_from(self, i: int) -> str:
        """The broker list that starts at node ``i`` and goes on round the others (``i``, ``i+1``, ...)."""
        urls = self.urls
        return ",".join(urls[i:] + urls[:i])

    @property
    def directory(self) -> Path | None:
        """The temporary folder holding every node's configuration, store and log."""
        return self._dir

    @property
    def running(self) -> bool:
        """Whether every node is alive."""
        return bool(self.nodes) and all(node.running for node in self.nodes)

    def log_text(self, i: int | None = None) -> str:
        """Node ``i``'s log, or every node's, each under a header (for failing tests)."""
        if i is not None:
            return self.nodes[i].log_text()
        return "".join(f"----- {node.name} ({node.mqtt_url}) -----\n{node.log_text()}" for node in self.nodes)

    # -- configuration -----------------------------------------------------------------------
    def _make_nodes(self) -> None:
        assert self._dir is not None
        ports = iter(free_ports(4 * self.n, self.host))
        for i in range(self.n):
            d = self._dir / f"n{i + 1}"
            d.mkdir(parents=True, exist_ok=True)
            self.nodes.append(NatsNode(i, f"fedsketch-n{i + 1}", self.host, d, client_port=next(ports),
                                       cluster_port=next(ports), mqtt_port=next(ports), http_port=next(ports)))

    def _authorization(self) -> list[str]:
        if self.users is None:
            return []
        lines = ["authorization {", "  users = ["]
        for user, password in self.users.items():
            entry = [f"user: {_quote(user)}", f"password: {_quote(password)}"]
            perms = self.permissions.get(user)
            if perms is not None:
                sub = list(perms.get("subscribe", []))
                if sub and "$MQTT.sub.>" not in sub:
                    sub.append("$MQTT.sub.>")
                entry.append("permissions: {" + f"publish: {_subjects(perms.get('publish', []))}, "
                             f"subscribe: {_subjects(sub)}" + "}")
            if self.mqtt_only:
                entry.append('allowed_connection_types: ["MQTT"]')
            lines.append("    {" + ", ".join(entry) + "}")
        lines += ["  ]", "}"]
        return lines

    def _write_conf(self, node: NatsNode) -> None:
        node.conf.write_text(self.node_conf(node))
        node.conf.chmod(0o600)

    def routes(self) -> list[str]:
        """Every node's route URL (``nats-route://host:port``), for a cluster's ``routes``."""
        return [f"nats-route://{self.host}:{other.cluster_port}" for other in self.nodes]

    def node_conf(self, node: NatsNode) -> str:
        """The configuration file of ``node`` (override to start from another, such as the shipped one).

        It must keep the node's ports (:class:`NatsNode`), ``server_name``,
        its JetStream ``store_dir`` and ``log_file: <node.directory>/nats.log``
        (:meth:`NatsNode.log_text` reads it) in ``node.directory``.
        """
        d = node.directory
        lines = [
            "# written by server_kit.broker.NatsCluster",
            f"server_name: {_quote(node.name)}",
            f"listen: {_quote(f'{self.host}:{node.client_port}')}",
            f"http: {_quote(f'{self.host}:{node.http_port}')}",
            f"log_file: {_quote(str(d / 'nats.log'))}",
            "jetstream {",
            f"  store_dir: {_quote(str(d / 'js'))}",
            "  max_memory_store: 256MB",
            "  max_file_store: 2GB",
            "}",
            "mqtt {",
            f"  listen: {_quote(f'{self.host}:{node.mqtt_port}')}",
            *([f'  ack_wait: "{int(self.ack_wait_s * 1000)}ms"'] if self.ack_wait_s is not None else []),
            "}",
        ]
        if self.max_payload is not None:
            lines.append(f"max_payload: {int(self.max_payload)}")
        if self.n > 1:
            routes = ", ".join(_quote(r) for r in self.routes())
            lines += ["cluster {", f"  name: {_quote(self.cluster_name)}",
                      f"  listen: {_quote(f'{self.host}:{node.cluster_port}')}", f"  routes: [{routes}]", "}"]
        lines += self._authorization()
        if self.extra_conf:
            lines.append(self.extra_conf)
        return "\n".join(lines) + "\n"

    # -- life cycle --------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> str:
        """Write the configurations, start every node, wait until the cluster serves MQTT; returns :attr:`url`.

        On a first start, ports that another process took between their choice and the node's bind are chosen
        again (up to :data:`PORT_TRIES` times); the error says so if every try lost the race.
        """
        if self.running:
            return self.url
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="fedsketch-nats-"))
        if self.nodes:
            return self._start_nodes(timeout)
        for attempt in range(1, PORT_TRIES + 1):
            self._make_nodes()
            try:
                return self._start_nodes(timeout)
            except PortTaken as e:
                log.warning("NATS cluster start %d of %d: %s; choosing other ports", attempt, PORT_TRIES, e)
                for node in self.nodes:
                    shutil.rmtree(node.directory, ignore_errors=True)
                self.nodes = []
        raise RuntimeError(f"the NATS cluster did not come up: its ports were taken on each of {PORT_TRIES} tries")

    def _start_nodes(self, timeout: float) -> str:
        for node in self.nodes:
            if not node.running:
                self._write_conf(node)
                node._spawn(self.binary or "nats-server")
        try:
            self._wait_ready(self.nodes, timeout)
        except (RuntimeError, TimeoutError) as e:
            text = "".join(node._stderr() for node in self.nodes) + self.log_text()
            self.stop()
            if "address already in use" in text:
                raise PortTaken(str(e)) from None
            raise RuntimeError(f"the NATS cluster did not come up: {e}\n{text}") from None
        log.info("NATS cluster of %d node(s) serving MQTT on %s (dir %s)", self.n, self.url, self._dir)
        return self.url

    def _wait_ready(self, nodes: Sequence[NatsNode], timeout: float, *, health: bool = True) -> None:
        """Each node's MQTT port accepts, routes and JetStream meta leader are there, (with ``health``) its
        ``healthz`` is ok, and (when it can log in) a node's first MQTT client is accepted: its JetStream
        session manager is set up."""
        deadline = time.monotonic() + timeout
        for node in nodes:
            wait_port(self.host, node.mqtt_port, max(0.1, deadline - time.monotonic()),
                      alive=lambda node=node: node.running)
        while True:
            why = self._not_ready(nodes, health=health)
            if why is None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{why} after {timeout:g} s")
            time.sleep(0.1)
        anonymous = self.users is None and "authorization" not in self.extra_conf
        if self.login is None and not anonymous:
            return
        user, password = self.login if self.login is not None else (None, None)
        for node in nodes:
            while True:
                try:
                    code = mqtt_connack(self.host, node.mqtt_port, f"fedsketch-ready-{node.index}",
                                        username=user, password=password,
                                        timeout=max(0.5, deadline - time.monotonic()))
                except OSError:  # closed before its CONNACK (a JetStream request timed out): again
                    code = -1
                if code == 0:
                    break
                if code in (4, 5):
                    raise RuntimeError(f"{node.name} refused the readiness login {user!r} (CONNACK {code})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node.name} accepts no MQTT client (CONNACK {code}) after {timeout:g} s")
                time.sleep(0.1)

    def _not_ready(self, nodes: Sequence[NatsNode], *, health: bool = True) -> str | None:
        """Why ``nodes`` do not serve MQTT yet (routes, meta leader, health), or None when they do."""
        for node in nodes:
            if not node.running:
                raise RuntimeError(f"{node.name} exited")
            if self.n > 1:
                routez = node.monitor("routez")
                routes = {r.get("remote_id") for r in (routez or {}).get("routes", [])}
                if len(routes) < self.n - 1:
                    return f"{node.name} has {len(routes)} of its {self.n - 1} routes"
                jsz = node.monitor("jsz") or {}
                if not (jsz.get("meta_cluster") or {}).get("leader"):
                    return f"{node.name} knows no JetStream meta leader"
            if not health:
                continue
            status = node.monitor("healthz") or {}
            if status.get("status") != "ok":
                return f"{node.name} is not healthy ({status.get('error', 'no answer')})"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node (SIGTERM, by PID); keeps the folder, ports and stores for :meth:`start` again."""
        for node in self.nodes:
            node._stop(timeout)

    def kill(self, i: int) -> None:
        """Kill node ``i`` at once (SIGKILL, by PID): its clients lose their connection without a goodbye."""
        node = self.nodes[i]
        if not node.running:
            raise RuntimeError(f"{node.name} is not running")
        node._stop(10.0, signal.SIGKILL)
        log.info("killed %s (%s)", node.name, node.mqtt_url)

    def restart(self, i: int, timeout: float = 90.0) -> str:
        """Start node ``i`` again (stopping it first if alive), same ports and store; wait until it rejoined.

        Returns its MQTT URL.
        """
        node = self.nodes[i]
        node._stop(timeout)
        self._write_conf(node)
        node._spawn(self.binary or "nats-server")
        try:
            # Not its healthz: on NATS 2.9 a restarted node can report a replicated consumer "not current" for
            # minutes while it serves. Routes, the meta leader and an accepted MQTT client say it is back.
            self._wait_ready([node], timeout, health=False)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{node.name} did not rejoin: {e}\n{node._stderr()}{node.log_text()}") from None
        return node.mqtt_url

    def cleanup(self) -> None:
        """Stop and delete the temporary folder."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.nodes = []

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

