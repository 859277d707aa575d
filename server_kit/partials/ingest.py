"""Ingest workers: W processes beside the server that take the devices' updates off its hands.

``fedsketch-server --ingest-workers W`` starts W :class:`PartialAggregator`
processes. The update topics are cut into W partitions: the server's
``train`` command names each device's (``partition``, a hash of its id over
W: :func:`edge_sdk.protocol.partition_of`) and the device publishes its
update on ``<root>/<federation>/clients/<id>/update/<p>``; worker ``p``
subscribes to ``clients/+/update/<p>`` alone. Each update reaches one worker
whole, with no second hop, on any MQTT broker (a NATS cluster too: no shared
subscription is needed). The worker decodes, decompresses, checks and holds
it, and sends the server a receipt; at the round's close, a partial sum per
model. The server keeps the phases and the state, receives only receipts and
partial sums, and does not subscribe to the updates itself.

Each worker signs with its own Ed25519 key, made at its start and given to
the server as an aggregator's key. A worker that dies is started again
(:meth:`IngestWorkers.revive`, at most once per :data:`RESTART_AFTER_S`), with
a new key; the round asks the devices whose updates it held, or that sent
theirs to its partition, for them again (:mod:`server_kit.rounds.reask`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from edge_sdk.logs import configure_logging, current_format
from edge_sdk.protocol import Kind, Message
from edge_sdk.signing import Signer, Verifier, generate_key, load_verifier
from edge_sdk.transport import BrokerConfig

from ..cores import Role, ThreadShare, limit_threads, plan
from .aggregator import DEFAULT_HOLD_MEMORY_BYTES

__all__ = ["PROBE_TIMEOUT_S", "RESTART_AFTER_S", "IngestRefused", "IngestWorkers"]

log = logging.getLogger(__name__)

#: The shortest time between two starts of one worker (a worker that dies at once is not started in a loop).
RESTART_AFTER_S = 5.0
#: How long the start waits for each worker's answer to its probe (:meth:`IngestWorkers.probe`).
PROBE_TIMEOUT_S = 10.0
#: The workers the shipped deploy/acl names (deploy/make_acl.py's default).
SHIPPED_ACL_WORKERS = 8


class IngestRefused(RuntimeError):
    """An ingest worker cannot do its job on this broker (its user refused, its partition unreadable): the
    server stops at its start, saying which user and topic."""


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs to start (plain values: it crosses a process start)."""

    index: int
    count: int
    broker: BrokerConfig
    federation: str
    root: str
    server_key: str | None
    log_level: int
    hold_memory_bytes: int
    log_format: str = "text"
    #: Where this worker serves its Prometheus metrics ((host, port)), or None.
    metrics: tuple[str, int] | None = None
    #: Its numpy/BLAS and torch threads (:mod:`server_kit.cores`).
    threads: ThreadShare | None = None


def _aid(index: int) -> str:
    return f"ingest-{index}"


def _worker_main(spec: WorkerSpec, key_pem: bytes, ready: Any) -> None:
    """One ingest worker's process: an aggregator on its partition of the update topics until its parent goes."""
    from cryptography.hazmat.primitives import serialization

    from edge_sdk.transport import MqttTransport

    from .aggregator import PartialAggregator

    configure_logging(spec.log_format, level=spec.log_level, component=_aid(spec.index),
                      text_format=f"%(asctime)s ingest-{spec.index} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C ends the server, which ends the workers
    if spec.threads is not None:
        limit_threads(spec.threads)
    parent = os.getppid()
    aid = _aid(spec.index)
    transport = MqttTransport(spec.broker, aid, federation=spec.federation, root=spec.root)
    transport.sign_with(Signer(serialization.load_pem_private_key(key_pem, password=None)))
    if spec.server_key:
        transport.verify_with(load_verifier(spec.server_key), scopes=("aggregation",))
    agg = PartialAggregator(transport, aid, updates_filter=transport.topics.partition_updates(spec.index),
                            hold_memory_bytes=spec.hold_memory_bytes)
    metrics = None
    if spec.metrics is not None:
        from ..watch.aggregator import serve_aggregator_metrics
        from ..watch.options import WatchError

        try:
            metrics = serve_aggregator_metrics(agg, spec.federation, host=spec.metrics[0], port=spec.metrics[1])
        except WatchError as e:  # the server is running already: this worker goes on without its metrics
            logging.getLogger(__name__).error("ingest worker %d exports no metrics: %s", spec.index, e)
    agg.start()
    transport.connect()
    # acknowledged after the broker took the subscriptions made on connecting (one connection, in order)
    transport.publish(transport.topics.aggregator(aid, "status"), Message(Kind.STATUS, spec.federation, aid, 0,
                                                                          {"state": "online"}), wait=True)
    ready.set()
    try:
        while os.getppid() == parent:
            time.sleep(0.5)
    finally:
        transport.close()
        agg.close()
        if metrics is not None:
            metrics.close()


class IngestWorkers:
    """W ingest worker processes: start them, know their keys, see whether each lives, start a dead one again,
    stop them.

    Parameters
    ----------
    count : int
        W, at least 1.
    broker : BrokerConfig
        The server's broker config, its protocol and session included (a
        worker started again resumes its session: the broker kept what came
        for its partition meanwhile). With a user name, worker ``i`` logs in
        as ``<user>-ingest-<i>`` with the same password (the broker's ACL must
        know those users).
    federation, root : str
        The federation's topics.
    server_key : str, optional
        The server's public key file: the workers then obey only its signed messages.
    hold_memory_bytes : int
        Each worker's memory for the updates it holds until their round closes (the rest wait on its disk:
        :class:`~.aggregator.PartialAggregator`).
    metrics_port : int, optional
        The server's ``--metrics-port`` P: worker ``i`` serves its metrics on P+1+i (at ``metrics_host``).
    threads : int, optional
        Each worker's numpy/BLAS and torch threads (``--worker-threads``); default: its share of the cores
        (:func:`server_kit.cores.plan`).
    """

    def __init__(self, count: int, broker: BrokerConfig, federation: str, *, root: str = "fedsketch",
                 server_key: str | None = None, hold_memory_bytes: int = DEFAULT_HOLD_MEMORY_BYTES,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1", threads: int | None = None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"ingest workers must be a positive integer, got {count!r}")
        self.count = count
        self._server_broker = broker
        #: Each worker's share of the cores (the same for all).
        self.threads = plan(Role.INGEST_WORKER, workers=count, override=threads)
        user = broker.username
        self._specs = [WorkerSpec(i, count, replace(broker, username=None if user is None else f"{user}-ingest-{i}"),
                                  federation, root, server_key, logging.getLogger().getEffectiveLevel(),
                                  hold_memory_bytes, current_format().value,
                                  None if metrics_port is None else (metrics_host, metrics_port + 1 + i),
                                  self.threads)
                       for i in range(count)]
        self._procs: dict[str, Any] = {}
        self._started: dict[str, float] = {}
        self._ready: dict[str, Any] = {}
        self._told_dead: set[str] = set()
        #: Restarts of each worker, by id.
        self.restarts: dict[str, int] = {}

    @property
    def ids(self) -> list[str]:
        """The workers' aggregator ids."""
        return [_aid(i) for i in range(self.count)]

    def start(self, timeout: float = 60.0, probe_timeout: float = PROBE_TIMEOUT_S) -> dict[str, Verifier]:
        """Start the W processes, wait until each is subscribed, and probe each one's partition (:meth:`probe`);
        returns each one's :class:`Verifier`, by id (for ``Orchestrator(aggregators=)``).

        Raises :class:`IngestRefused` (the workers stopped) for a worker that exits before it subscribed (the
        broker refused its user, say), one not subscribed ``timeout`` s after its start, or one whose probe
        gets no answer."""
        verifiers = {_aid(spec.index): self._start(spec) for spec in self._specs}
        try:
            self._wait_ready(timeout)
            self.probe(verifiers, probe_timeout)
        except IngestRefused:
            self.stop()
            raise
        log.info("%d ingest worker(s) ready, worker p on the update topics' partition p, each %s: %s", self.count,
                 self.threads.describe(), ", ".join(f"{aid} (pid {p.pid})" for aid, p in self._procs.items()))
        return verifiers

    def _wait_ready(self, timeout: float) -> None:
        """Wait until every worker said it is subscribed; IngestRefused for one that died or is late."""
        deadline = time.monotonic() + timeout
        for spec in self._specs:
            aid = _aid(spec.index)
            proc, ready = self._procs[aid], self._ready[aid]
            while not ready.wait(0.1):
                if not proc.is_alive():
                    raise IngestRefused(
                        f"ingest worker {aid} (broker user {spec.broker.username or '(none)'}) exited with code "
                        f"{proc.exitcode} before it subscribed; its log above says why (a user the broker does "
                        f"not know? deploy/make_passwords.sh N FILE PREFIX W adds the W workers' users)")
                if time.monotonic() > deadline:
                    raise IngestRefused(f"ingest worker {aid} not subscribed {timeout:g} s after its start "
                                        f"(broker {spec.broker.url}); see its log")

    def probe(self, verifiers: dict[str, Verifier], timeout: float = PROBE_TIMEOUT_S) -> None:
        """Check that worker ``p`` reads partition ``p`` of the update topics and that its answers reach the server.

        A broker grants a subscription its ACL forbids and then drops what it may not read (Mosquitto 2.0), so a
        subscribed worker proves nothing: with the server's credentials, a STATUS with a probe is published on
        ``clients/probe-ingest-<p>/update/<p>`` (again every second) and the worker must echo it, signed, on its
        status topic within ``timeout`` s. IngestRefused names the user and the topic of each that does not.
        """
        from edge_sdk.transport import MqttTransport

        nonce = secrets.token_hex(6)
        seen: set[str] = set()
        done = threading.Event()
        spec0 = self._specs[0]
        # one client id for every start: a broker keeps a session for it, not one per start
        probe = MqttTransport(self._server_broker, f"{self._server_broker.username or 'server'}-ingest-probe",
                              federation=spec0.federation, root=spec0.root)
        probe.accept_aggregators(verifiers)
        topics = probe.topics

        def answered(topic: str, msg: Message) -> None:
            if msg.kind == Kind.STATUS and msg.meta.get("probe") == f"{nonce}-{msg.sender}":
                seen.add(msg.sender)
                if len(seen) == self.count:
                    done.set()

        probe.subscribe(topics.aggregator("+", "status"), answered)
        try:
            probe.connect(timeout=10)
            deadline = time.monotonic() + timeout
            while not done.is_set() and time.monotonic() < deadline:
                for spec in self._specs:
                    aid = _aid(spec.index)
                    if aid not in seen:
                        cid = f"probe-{aid}"
                        probe.publish(topics.update(cid, spec.index),
                                      Message(Kind.STATUS, spec.federation, cid, 0, {"probe": f"{nonce}-{aid}"}))
                done.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        except (ConnectionError, TimeoutError, OSError) as e:
            raise IngestRefused(f"could not probe the ingest workers' partitions: {e}") from None
        finally:
            probe.unsubscribe(topics.aggregator("+", "status"))
            probe.close()
        missing = [spec for spec in self._specs if _aid(spec.index) not in seen]
        if missing:
            raise IngestRefused("; ".join(
                f"ingest worker {_aid(s.index)} (broker user {s.broker.username or '(none)'}) did not answer a "
                f"probe on {topics.update(f'probe-{_aid(s.index)}', s.index)} within {timeout:g} s: the broker "
                f"must let it read {topics.partition_updates(s.index)} and write "
                f"{topics.base}/aggregators/{_aid(s.index)}/#" for s in missing)
                + f". The shipped deploy/acl names {SHIPPED_ACL_WORKERS} workers; for more: deploy/make_acl.py "
                  f"--ingest-workers {self.count} (a NATS cluster: deploy/nats/make_users.py --ingest-workers "
                  f"{self.count})")
        log.info("ingest workers probed: each reads its partition of the update topics")

    def _start(self, spec: WorkerSpec) -> Verifier:
        from cryptography.hazmat.primitives import serialization

        key = generate_key()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        aid = _aid(spec.index)
        ctx = mp.get_context("spawn")
        self._ready[aid] = ready = ctx.Event()
        proc = ctx.Process(target=_worker_main, args=(spec, pem, ready), name=aid, daemon=True)
        proc.start()
        self._procs[aid] = proc
        self._started[aid] = time.monotonic()
        self._told_dead.discard(aid)
        return Verifier(key.public_key())

    def revive(self) -> dict[str, Verifier]:
        """Start again every worker that died (each at most once per :data:`RESTART_AFTER_S`); their new keys."""
        revived = {}
        now = time.monotonic()
        for spec in self._specs:
            aid = _aid(spec.index)
            if self.alive(aid) or now - self._started.get(aid, 0.0) < RESTART_AFTER_S:
                continue
            old = self._procs[aid]
            revived[aid] = self._start(spec)
            self.restarts[aid] = self.restarts.get(aid, 0) + 1
            log.warning("ingest worker %s (pid %s, exit code %s) started again as pid %s", aid, old.pid,
                        old.exitcode, self._procs[aid].pid)
        return revived

    def alive(self, aid: str) -> bool:
        """Whether worker ``aid`` runs (a death is logged once)."""
        proc = self._procs.get(aid)
        if proc is None:
            return False
        if proc.is_alive():
            return True
        if aid not in self._told_dead:
            self._told_dead.add(aid)
            log.error("ingest worker %s (pid %s) died with exit code %s", aid, proc.pid, proc.exitcode)
        return False

    def pid(self, aid: str) -> int | None:
        """The process id of worker ``aid``."""
        proc = self._procs.get(aid)
        return None if proc is None else proc.pid

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after ``timeout``)."""
        for proc in self._procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)

    def __enter__(self) -> IngestWorkers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
