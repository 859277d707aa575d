"""Ingest workers: W processes beside the server that take the devices' updates off its hands.

``fedsketch-server --ingest-workers W`` starts W :class:`PartialAggregator`
processes on one MQTT shared subscription of the updates
(``$share/fedsketch-ingest/<root>/<federation>/clients/+/update``; MQTT 5, as
Mosquitto 2.0 and EMQX serve it). The broker hands each update to one of
them; the worker decodes, decompresses, checks and holds it, and sends the
server a receipt; at the round's close, a partial sum per model. The server
keeps the phases and the state and does not subscribe to the updates itself.

A shared subscription spreads messages, not transfers: the chunks of one
large update reach several workers. Each chunk goes to the worker that owns
its sender (a hash of the device id over the W workers), through a pipe
between the two processes; that worker reassembles the update.

Each worker signs with its own Ed25519 key, made at start and given to the
server as an aggregator's key. A worker that dies is not restarted: the
server refuses the updates it held (``aggregator-lost``), and the broker
gives the shared subscription's next messages to the others (a worker's
session ends with its connection).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import struct
import threading
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any

from edge_sdk.signing import Signer, Verifier, generate_key, load_verifier
from edge_sdk.transport import BrokerConfig

__all__ = ["INGEST_GROUP", "IngestWorkers", "owner_of"]

log = logging.getLogger(__name__)

#: The shared subscription's group name.
INGEST_GROUP = "fedsketch-ingest"
_FRAME = struct.Struct(">H")


def owner_of(sender: str, count: int) -> int:
    """The worker (of ``count``) that reassembles ``sender``'s chunked transfers."""
    return zlib.crc32(sender.encode("utf-8")) % count


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


def _aid(index: int) -> str:
    return f"ingest-{index}"


class _Router:
    """Hands each chunk to the worker that owns its sender; takes the chunks the others hand this one."""

    def __init__(self, index: int, count: int, writers: dict[int, Any]) -> None:
        self.index, self.count = index, count
        self.writers = dict(writers)
        self._locks = {j: threading.Lock() for j in writers}

    def __call__(self, topic: str, sender: str, payload: bytes) -> bool:
        if not topic.endswith("/update"):
            return False  # the server's messages reach every worker: each reassembles its own copy
        j = owner_of(sender, self.count)
        conn = self.writers.get(j)
        if j == self.index or conn is None:
            return False  # this worker's own, or its owner is gone: reassembled here
        t = topic.encode("utf-8")
        try:
            with self._locks[j]:
                conn.send_bytes(_FRAME.pack(len(t)) + t + payload)
        except OSError:
            log.warning("ingest worker %d: worker %d is gone; %s's chunks are reassembled here", self.index, j,
                        sender)
            self.writers.pop(j, None)
            return False
        return True


def _pump_pipe(conn: Any, transport: Any) -> None:
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            return
        (n,) = _FRAME.unpack_from(frame)
        transport.inject(frame[2:2 + n].decode("utf-8"), frame[2 + n:])


def _worker_main(spec: WorkerSpec, key_pem: bytes, readers: list[Any], writers: dict[int, Any]) -> None:
    """One ingest worker's process: an aggregator on the shared subscription until its parent goes."""
    from cryptography.hazmat.primitives import serialization

    from edge_sdk.transport import MqttTransport

    from .aggregator import PartialAggregator

    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s ingest-{spec.index} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C ends the server, which ends the workers
    parent = os.getppid()
    aid = _aid(spec.index)
    transport = MqttTransport(spec.broker, aid, federation=spec.federation, root=spec.root)
    transport.sign_with(Signer(serialization.load_pem_private_key(key_pem, password=None)))
    if spec.server_key:
        transport.verify_with(load_verifier(spec.server_key), scopes=("aggregation",))
    shared = f"$share/{INGEST_GROUP}/{transport.topics.all_clients('update')}"
    agg = PartialAggregator(transport, aid, updates_filter=shared)
    if spec.count > 1:
        transport.route_chunks(_Router(spec.index, spec.count, writers))
        for conn in readers:
            threading.Thread(target=_pump_pipe, args=(conn, transport), daemon=True).start()
    agg.start()
    transport.connect()
    while os.getppid() == parent:
        time.sleep(0.5)
    transport.close()


class IngestWorkers:
    """W ingest worker processes: start them, know their keys, see whether each lives, stop them.

    Parameters
    ----------
    count : int
        W, at least 1.
    broker : BrokerConfig
        The server's broker config; the workers speak MQTT 5 with sessions
        that end with their connection (a dead worker's share goes to the
        others). With a user name, worker ``i`` logs in as ``<user>-ingest-<i>``
        with the same password (the broker's ACL must know those users).
    federation, root : str
        The federation's topics.
    server_key : str, optional
        The server's public key file: the workers then obey only its signed messages.
    """

    def __init__(self, count: int, broker: BrokerConfig, federation: str, *, root: str = "fedsketch",
                 server_key: str | None = None) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"ingest workers must be a positive integer, got {count!r}")
        self.count = count
        user = broker.username
        self._specs = [WorkerSpec(i, count, replace(broker, protocol="5", session_expiry_s=0,
                                                    username=None if user is None else f"{user}-ingest-{i}"),
                                  federation, root, server_key, logging.getLogger().getEffectiveLevel())
                       for i in range(count)]
        self._procs: dict[str, Any] = {}
        self._told_dead: set[str] = set()

    @property
    def ids(self) -> list[str]:
        """The workers' aggregator ids."""
        return [_aid(i) for i in range(self.count)]

    def start(self) -> dict[str, Verifier]:
        """Start the W processes; returns each one's :class:`Verifier`, by id (for ``Orchestrator(aggregators=)``)."""
        from cryptography.hazmat.primitives import serialization

        ctx = mp.get_context("spawn")
        pipes = {(i, j): ctx.Pipe(duplex=False) for i in range(self.count) for j in range(self.count) if i != j}
        verifiers = {}
        for spec in self._specs:
            key = generate_key()
            pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
            i = spec.index
            readers = [pipes[(j, i)][0] for j in range(self.count) if j != i]
            writers = {j: pipes[(i, j)][1] for j in range(self.count) if j != i}
            proc = ctx.Process(target=_worker_main, args=(spec, pem, readers, writers), name=_aid(i), daemon=True)
            proc.start()
            self._procs[_aid(i)] = proc
            verifiers[_aid(i)] = Verifier(key.public_key())
        for reader, writer in pipes.values():  # the children hold their ends
            reader.close()
            writer.close()
        log.info("%d ingest worker(s) started on the shared subscription $share/%s/...: %s", self.count,
                 INGEST_GROUP, ", ".join(f"{aid} (pid {p.pid})" for aid, p in self._procs.items()))
        return verifiers

    def alive(self, aid: str) -> bool:
        """Whether worker ``aid`` runs (a death is logged once)."""
        proc = self._procs.get(aid)
        if proc is None:
            return False
        if proc.is_alive():
            return True
        if aid not in self._told_dead:
            self._told_dead.add(aid)
            log.error("ingest worker %s (pid %s) died with exit code %s; the others take the updates",
                      aid, proc.pid, proc.exitcode)
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
