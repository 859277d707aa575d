"""FedCRef over MQTT, the device's side: a loop that answers the coordinator's commands.

:class:`FedCRefEdge` connects a :class:`~edge_sdk.fedcref.FedCRefClient` to a
transport (:class:`~edge_sdk.transport.MqttTransport`, or
:class:`~edge_sdk.transport.MemoryTransport` in tests). The server's side is
:class:`server_kit.fedcref.mqtt.FedCRefCoordinator`; the objects, kinds and
topics are those of the table in :mod:`server_kit.fedcref`:

* ``register`` (CMD on ``broadcast/cmd``): say hello again on ``clients/<id>/hello``
  (the hello of :meth:`~edge_sdk.fedcref.FedCRefClient.initialize`, computed once);
* ``iterate`` (CMD on ``clients/<id>/cmd``): ``train_models``, answer ``cluster_models``
  (UPDATE on ``clients/<id>/update``);
* ``cluster_models`` (MODEL on ``clients/<id>/cmd``, another client's models relayed by the
  server): ``receive_models``, no answer;
* ``associate`` (CMD on ``clients/<id>/cmd``): ``association_report``, answer ``association``
  (FEATURES on ``clients/<id>/sketch``);
* ``community_model`` (MODEL on ``clients/<id>/cmd``): ``community_update`` when a member,
  answer ``community_update`` (UPDATE on ``clients/<id>/update``);
* ``community_models`` (MODEL on ``clients/<id>/cmd``): ``refine``, answer ``refined``
  (METRICS on ``clients/<id>/metrics``);
* ``stop`` (CMD on ``clients/<id>/cmd``): leave the loop.

A client whose models did not change answers ``iterate`` with an empty
``cluster_models`` object marked ``"unchanged": true``, so the server knows
it is done. A ``community_model`` message goes to each member of the
community on its command topic; its ``members`` maps the client to its
member clusters (a client not named there ignores it). The device writes
only under its own ``clients/<id>/`` and reads only its commands and the
broadcasts: the shipped ``deploy/acl`` holds.

Handlers only queue messages; the work runs in :meth:`FedCRefEdge.run`'s
thread. Because :class:`~edge_sdk.fedcref.FedCRefClient` seeds torch's global
random generator while it builds models, the edges of one process (tests,
simulations) take turns through a shared lock; on a device there is one edge
and the lock costs nothing. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from ..protocol import SERVER_ID, Kind, Message, ProtocolError, Topics, parse_tensors, tensors_body
from .client import FedCRefClient

__all__ = ["FedCRefEdge", "SERVER_ID"]

log = logging.getLogger(__name__)


#: Serialises the FedCRefClient calls of the edges that share a process (see the module docstring).
_COMPUTE_LOCK = threading.Lock()


class FedCRefEdge:
    """One device of a FedCRef federation behind a broker.

    Parameters
    ----------
    client : FedCRefClient
        The device's data and FedCRef operations (not initialised yet:
        :meth:`start` calls :meth:`~edge_sdk.fedcref.FedCRefClient.initialize`).
    transport : MqttTransport or MemoryTransport
        Its ``client_id`` must be ``client.cid`` (the broker user name the
        ACL ties to ``clients/<id>/``); connected or not.
    lock : threading.Lock, optional
        Held around every FedCRefClient call; default: one lock shared by
        the edges of this process.

    Attributes
    ----------
    handled_ : dict of str to int
        Messages handled per ``meta["type"]``.
    errors_ : list of str
        Why messages were refused or commands failed.
    """

    def __init__(self, client: FedCRefClient, transport: Any, *, lock: Optional[Any] = None) -> None:
        if not isinstance(client, FedCRefClient):
            raise ValueError(f"client must be a FedCRefClient, got {type(client).__name__}")
        if transport.client_id != client.cid:
            raise ValueError(
                f"transport client_id {transport.client_id!r} must be the client's id {client.cid!r} "
                "(the ACL ties the broker user to clients/<id>/)"
            )
        self.client = client
        self.transport = transport
        self.cid = client.cid
        self.topics: Topics = transport.topics
        self.federation = transport.federation
        self.lock = _COMPUTE_LOCK if lock is None else lock
        self.handled_: dict[str, int] = {}
        self.errors_: list[str] = []
        self._queue: queue.Queue[Message] = queue.Queue(maxsize=10_000)
        self._stop = threading.Event()
        self._hello: Optional[dict[str, Any]] = None
        self._started = False

    # ------------------------------------------------------------------ transport callbacks (enqueue only)

    def _on_message(self, topic: str, msg: Message) -> None:
        if msg.sender != SERVER_ID or msg.kind not in (Kind.CMD, Kind.MODEL):
            self._refuse(f"ignored {msg.kind.name} from {msg.sender!r} on {topic}")
            return
        try:
            self._queue.put_nowait(msg)
        except queue.Full:
            self._refuse(f"queue full: dropped {msg.meta.get('type')!r}")

    def _refuse(self, why: str) -> None:
        self.errors_.append(why)
        log.warning("client %s: %s", self.cid, why)

    # ------------------------------------------------------------------ outgoing

    def _send(self, topic: str, kind: Kind, payload: tuple[Mapping[str, Any], Mapping[str, np.ndarray]],
              rnd: int = 0) -> None:
        meta, tensors = payload
        body = tensors_body(tensors) if tensors else b""
        self.transport.publish(topic, Message(kind, self.federation, self.cid, int(rnd), dict(meta), body))

    def start(self) -> None:
        """Subscribe, connect, compute the initial clustering and say hello."""
        if self._started:
            return
        self.transport.subscribe(self.topics.cmd(self.cid), self._on_message)
        self.transport.subscribe(self.topics.broadcast(), self._on_message)
        self.transport.connect()
        with self.lock:
            self._hello, _ = self.client.initialize()
        self._started = True
        self._send(self.topics.hello(self.cid), Kind.HELLO, (self._hello, {}))

    # ------------------------------------------------------------------ commands

    def handle(self, msg: Message) -> bool:
        """Carry out one message; returns False when told to stop."""
        m = msg.meta
        what = str(m.get("type", ""))
        self.handled_[what] = self.handled_.get(what, 0) + 1
        if what == "stop":
            return False
        try:
            tensors = parse_tensors(msg.body) if msg.body else {}
            if msg.kind == Kind.CMD and what == "register":
                if self._hello is not None:
                    self._send(self.topics.hello(self.cid), Kind.HELLO, (self._hello, {}))
            elif msg.kind == Kind.CMD and what == "iterate":
                with self.lock:
                    up = self.client.train_models(m)
                if up is None:
                    up = ({"type": "cluster_models", "cid": self.cid, "iteration": int(m["iteration"]),
                           "unchanged": True}, {})
                self._send(self.topics.update(self.cid), Kind.UPDATE, up, msg.round)
            elif msg.kind == Kind.MODEL and what == "cluster_models":
                with self.lock:
                    self.client.receive_models(m, tensors)
            elif msg.kind == Kind.CMD and what == "associate":
                with self.lock:
                    report = self.client.association_report(m)
                self._send(self.topics.sketch(self.cid), Kind.FEATURES, report, msg.round)
            elif msg.kind == Kind.MODEL and what == "community_model":
                members = m.get("members", {})
                if not isinstance(members, Mapping):
                    raise ValueError("community_model members must map client ids to cluster lists")
                if self.cid not in members:
                    return True
                own = dict(m, members=list(members[self.cid]))
                with self.lock:
                    meta, weights = self.client.community_update(own, tensors)
                meta = dict(meta, iteration=int(m.get("iteration", 0)))
                self._send(self.topics.update(self.cid), Kind.UPDATE, (meta, weights), msg.round)
            elif msg.kind == Kind.MODEL and what == "community_check":
                with self.lock:
                    report = self.client.community_check(m, tensors)
                self._send(self.topics.sketch(self.cid), Kind.FEATURES, report, msg.round)
            elif msg.kind == Kind.MODEL and what == "community_models":
                with self.lock:
                    report = self.client.refine(m, tensors)
                self._send(self.topics.metrics(self.cid), Kind.METRICS, report, msg.round)
            else:
                self._refuse(f"unknown {msg.kind.name} {what!r} ignored")
        except (ProtocolError, ValueError, KeyError, TypeError, RuntimeError) as e:
            self._refuse(f"{msg.kind.name} {what!r} failed: {e}")
        except Exception as e:  # no message may end the device
            log.debug("handler error", exc_info=True)
            self._refuse(f"{msg.kind.name} {what[:32]!r} failed: {type(e).__name__}: {e}")
        return True

    def run(self, *, max_idle_s: Optional[float] = None, close: bool = True) -> None:
        """Start, then carry out messages until ``stop`` (or ``max_idle_s`` without any).

        Parameters
        ----------
        max_idle_s : float, optional
            Leave after this many seconds without a message.
        close : bool
            Close the transport when leaving.
        """
        try:
            self.start()
            idle_since = time.monotonic()
            while not self._stop.is_set():
                try:
                    msg = self._queue.get(timeout=0.2)
                except queue.Empty:
                    if max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                        log.warning("client %s: no message for %g s, leaving", self.cid, max_idle_s)
                        break
                    continue
                idle_since = time.monotonic()
                if not self.handle(msg):
                    log.info("client %s: the server said stop", self.cid)
                    break
        finally:
            if close:
                self.transport.close()

    def stop(self) -> None:
        """Make :meth:`run` return after the message in hand."""
        self._stop.set()
