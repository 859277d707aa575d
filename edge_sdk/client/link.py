"""A device's connection to the server: its topics, what it sends, what it receives, when it says hello.

:class:`DeviceLink` wraps the device's transport. On the network thread it
only sorts what arrives: a model goes to the device's state at once (ahead
of the command that uses it), a command or the server's status is queued
for the client's loop, marked with the way it came (:data:`VIA`). It keeps
the model topics the device follows, sends every envelope, and schedules
the hello after each (re)connection. What the device does with a command is
:mod:`edge_sdk.client.commands`; what the runs gave it, :mod:`edge_sdk.client.state`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..models.held_models import NEEDS_WHOLE
from ..protocol import SERVER_ID, Kind, Message, ProtocolError, Topics
from ..rejections import RejectionLog
from ..schema import check_meta

__all__ = ["LOCAL", "SERVER_STATUS", "VIA", "DeviceLink"]

# the device's log keeps its one name: these lines were the client's and still are
log = logging.getLogger("edge_sdk.client")

#: Meta key the device's own command callback adds: the topic a command came by ("cmd" or "broadcast").
VIA = "_via"
#: The ``VIA`` of the application's own command (:meth:`edge_sdk.client.EdgeClient.data_changed`), never of a message.
LOCAL = "local"
#: The ``VIA`` of the server's own status (its run announcement on ``server/status``).
SERVER_STATUS = "server-status"


class DeviceLink:
    """One device's connection: topics, the queue of commands, the models followed, the hello's time.

    Parameters
    ----------
    transport : MqttTransport or MemoryTransport
        Connected or not; :meth:`start` connects it.
    cid, federation : str
        The device and its federation (the sender and federation of what it sends).
    topics : Topics
        The federation's topic names.
    receive_model : callable
        ``receive_model(msg, meta)``: keeps a model from the server (network thread);
        it may raise :class:`ProtocolError`, counted as a rejection.
    server_back : callable
        Called on the network thread when the server is online again after it said it was
        away, before the models it sends next.
    rejections : RejectionLog
        Where refused messages are counted.
    hello_jitter_s : float
        After every (re)connection the hello goes out after a random wait of up to this many seconds.
    """

    def __init__(self, transport: Any, *, cid: str, federation: str, topics: Topics,
                 receive_model: Callable[[Message, Mapping[str, Any]], None], server_back: Callable[[], None],
                 rejections: RejectionLog, hello_jitter_s: float = 0.0) -> None:
        if not float(hello_jitter_s) >= 0:
            raise ValueError(f"hello_jitter_s must be a non-negative number of seconds, got {hello_jitter_s!r}")
        self.transport = transport
        self.cid = cid
        self.federation = federation
        self.topics = topics
        self.hello_jitter_s = float(hello_jitter_s)
        #: The server's commands and status, and the application's wake-ups, for the client's loop.
        self.commands: queue.Queue[Message] = queue.Queue(maxsize=1000)
        #: The model topic filters this device subscribes to (every model until an assign narrows it).
        self.followed: frozenset[str] = frozenset({topics.model("+")})
        self._receive_model = receive_model
        self._server_back = server_back
        self._reject = rejections
        self._hello_due: float | None = None  # when the scheduled hello goes out (monotonic), if one is
        self._hello_lock = threading.Lock()
        self._jitter = random.Random()  # from the OS: devices must not jitter alike
        self._connections = 0
        #: The network thread's own record that the server said it was away.
        self._server_was_away = False

    # -- incoming (network thread: sort and queue only) ------------------------------
    def on_command(self, topic: str, msg: Message) -> None:
        """A message on the device's command topic or the broadcast topic."""
        if msg.kind == Kind.MODEL and msg.sender == SERVER_ID and topic == self.topics.cmd(self.cid):
            self.on_model(topic, msg)  # a model for this client alone, ahead of the command that uses it
            return
        if msg.kind != Kind.CMD or msg.sender != SERVER_ID:
            self._reject("sender", msg.sender, f"ignoring {msg.kind.name} on {topic}")
            return
        # which topic it came by (a broadcast may not concern this device); set here, never by the sender
        self.enqueue(msg, "broadcast" if topic == self.topics.broadcast() else "cmd")

    def enqueue(self, msg: Message, via: str) -> None:
        """Queue a message from the server for the client's loop, marked with the way it came (``VIA``)."""
        msg = dataclasses.replace(msg, meta={**msg.meta, VIA: via})
        try:
            self.commands.put_nowait(msg)
        except queue.Full:
            what = msg.meta.get("op") if via != SERVER_STATUS else "the server's status"
            self._reject("queue-full", msg.sender, f"command queue full; dropping {what!r}")

    def wake(self) -> None:
        """Wake the client's loop for the application's own command (a full queue is fine: it is seen anyway)."""
        try:
            self.commands.put_nowait(Message(Kind.CMD, self.federation, self.cid, 0, {VIA: LOCAL}))
        except queue.Full:
            pass

    def on_model(self, topic: str, msg: Message) -> None:
        """A model (or an encoder) from the server: checked, then kept at once."""
        if msg.kind != Kind.MODEL or msg.sender != SERVER_ID:
            return
        try:
            meta = check_meta(msg)
            self._receive_model(msg, meta)
        except ProtocolError as e:
            self._reject(e.reason, msg.sender, f"model for round {msg.round}: {e}")
            if e.reason in NEEDS_WHOLE:  # what it was sent does not apply to its copy: ask for the model whole
                self.send(self.topics.status(self.cid), Kind.STATUS, msg.round,
                          {"state": "online", "need": [meta["key"]]})
        except Exception as e:  # never let a message end the device
            self._reject("handler-error", msg.sender, f"model: {type(e).__name__}: {e}")

    def on_server_status(self, topic: str, msg: Message) -> None:
        """The server's status: queued, handled on the client's loop between two commands."""
        if msg.kind != Kind.STATUS or msg.sender != SERVER_ID:
            self._reject("sender", msg.sender, f"ignoring {msg.kind.name} on {topic}")
            return
        state = msg.meta.get("state")
        will = msg.meta.get("will")
        if state == "online" and isinstance(will, str) and len(will) <= 64:
            self.transport.admit_signed(will)  # the server's last will: accepted whatever its age, once
        if state == "offline":
            self._server_was_away = True
        elif state == "online" and self._server_was_away:
            # here, before the models the server sends next: a resumed run's rounds may be below the ones held
            self._server_was_away = False
            self._server_back()
        self.enqueue(msg, SERVER_STATUS)

    # -- outgoing -----------------------------------------------------------------
    def send(self, topic: str, kind: Kind, rnd: int = 0, meta: Mapping[str, Any] | None = None,
             body: bytes = b"") -> None:
        """Publish one envelope from this device."""
        self.transport.publish(topic, Message(kind, self.federation, self.cid, rnd, dict(meta or {}), body))

    def follow(self, keys: Sequence[str], *, confirm: bool = True) -> None:
        """Keep the model topics of ``keys`` ("+": every model), leave the others; say so on the status topic.

        The status (``confirm``) goes out after the (un)subscriptions on the
        same connection, so the broker has them when the server reads it: from
        then on the server counts on this device getting exactly these topics.
        The server's "hello" request (a new run) puts it back on every model,
        unconfirmed: the new server assumes it of a device it has not assigned.
        """
        want = frozenset({self.topics.model("+")} if "+" in keys else {self.topics.model(k) for k in keys})
        for f in sorted(want - self.followed):
            self.transport.subscribe(f, self.on_model)
        for f in sorted(self.followed - want):
            self.transport.unsubscribe(f)
        self.followed = want
        follow = ["+"] if "+" in keys else sorted(set(keys))
        if not confirm:
            return
        self.send(self.topics.status(self.cid), Kind.STATUS, meta={"state": "online", "follow": follow})
        log.info("following the model topics of %s", ", ".join(follow) or "no model")

    # -- the hello's time -----------------------------------------------------------
    @property
    def hello_due(self) -> float | None:
        """When the hello scheduled by the last (re)connection goes out (``time.monotonic()``), or None."""
        return self._hello_due

    def schedule_hello(self) -> float:
        """Say hello up to ``hello_jitter_s`` from now; returns the wait.

        A hello already scheduled keeps its (earlier) time.
        """
        delay = self._jitter.uniform(0.0, self.hello_jitter_s) if self.hello_jitter_s else 0.0
        with self._hello_lock:
            due = time.monotonic() + delay
            if self._hello_due is None or due < self._hello_due:
                self._hello_due = due
            return max(0.0, self._hello_due - time.monotonic())

    def hello_is_due(self) -> bool:
        """Whether the scheduled hello should go out now."""
        with self._hello_lock:
            return self._hello_due is not None and self._hello_due <= time.monotonic()

    def hello_sent(self) -> None:
        """A hello went out: the one scheduled, if any, would say the same."""
        with self._hello_lock:
            self._hello_due = None

    def _on_connected(self) -> None:
        """Every (re)connection: schedule a hello (network thread: no wait)."""
        self._connections += 1
        delay = self.schedule_hello()
        if self._connections > 1:
            log.info("reconnected: announcing this device again in %.1f s", delay)

    # -- the connection -----------------------------------------------------------
    def start(self) -> None:
        """Subscribe, connect, and schedule the hello (again after every reconnection)."""
        self.transport.subscribe(self.topics.cmd(self.cid), self.on_command)
        self.transport.subscribe(self.topics.broadcast(), self.on_command)
        self.transport.subscribe(self.topics.server_status(), self.on_server_status)
        for f in sorted(self.followed):  # every model until an assign says which to follow
            self.transport.subscribe(f, self.on_model)
        self.transport.on_connected(self._on_connected)
        self.transport.connect()
        if self._connections == 0:  # connected before this listener was added (connect(wait=False) on a loop)
            self._on_connected()

    def close(self) -> None:
        """Disconnect."""
        self.transport.close()
