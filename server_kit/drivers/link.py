"""The server's end of the wire: what it sends, and an inbox of what arrives, handled one message at a time.

A :class:`ServerLink` wraps a transport (:class:`edge_sdk.transport.MqttTransport`,
or its in-memory twin in unit tests) for a server driver:

- sending: :meth:`~ServerLink.send` (any message, stamped with the driver's
  current round), :meth:`~ServerLink.command` (a CMD to one device) and
  :meth:`~ServerLink.broadcast` (a CMD to every device);
- receiving: :meth:`~ServerLink.subscribe` puts every message of the
  device topics in a bounded inbox (the transport's threads only enqueue);
  :meth:`~ServerLink.pump` (or :meth:`~ServerLink.drain`, without waiting)
  takes them out on the driver's thread and hands each to the driver's handler through :meth:`~ServerLink.handle_safely`,
  where whatever the handler raises is a counted rejection, never the end of
  the server.

The driver brings its handler, the way it counts and logs rejections
(``rejections(reason, sender, detail)``, e.g. an :class:`edge_sdk.rejections.RejectionLog`),
the round it is in, and, if it words them otherwise than :func:`explain_rejection`,
how a handler's exception becomes a rejection's reason and detail.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from edge_sdk.protocol import SERVER_ID, Kind, Message, ProtocolError, Topics
from edge_sdk.protocol.commands import Op, build

__all__ = ["INBOX_SIZE", "ServerLink", "explain_rejection"]

#: Messages the inbox holds; past it a message is dropped (an ``inbox-full`` rejection).
INBOX_SIZE = 100_000

log = logging.getLogger(__name__)


def explain_rejection(msg: Message, error: Exception) -> tuple[str, str]:
    """The reason and detail of refusing ``msg``, whose handler raised ``error``.

    A :class:`~edge_sdk.protocol.ProtocolError` names its reason; any other
    ``ValueError``, ``KeyError`` or ``TypeError`` is "invalid"; anything
    else is a "handler-error" (a handler bug a message could trigger).
    """
    if isinstance(error, ProtocolError):
        return error.reason, f"{msg.kind.name}: {error}"
    if isinstance(error, (ValueError, KeyError, TypeError)):
        return "invalid", f"{msg.kind.name}: {error}"
    return "handler-error", f"{msg.kind.name}: {type(error).__name__}: {error}"


class ServerLink:
    """Sends a server's messages over a transport and pumps what arrives through a handler.

    Parameters
    ----------
    transport : Any
        Publishes and subscribes (``publish(topic, msg, retain=...)``, ``subscribe(filter, callback)``).
    topics : Topics
        The federation's topics.
    federation : str
        Stamped on every message sent.
    handler : callable
        ``handler(topic, msg)``: the driver's handling of one message.
    rejections : callable
        ``rejections(reason, sender, detail)``: counts (and logs) a refused message (a ``RejectionLog``).
    round_of : callable
        The round stamped on every message sent (the driver's current round).
    explain : callable
        ``explain(msg, error) -> (reason, detail)``: what the handler's exception makes of the rejection.
    inbox_size : int
        Messages the inbox holds.
    """

    def __init__(self, transport: Any, topics: Topics, federation: str, *,
                 handler: Callable[[str, Message], None], rejections: Callable[[str, str, str], None],
                 round_of: Callable[[], int] = lambda: 0,
                 explain: Callable[[Message, Exception], tuple[str, str]] = explain_rejection,
                 inbox_size: int = INBOX_SIZE) -> None:
        self.transport = transport
        self.topics = topics
        self.federation = federation
        self.handler = handler
        self.round_of = round_of
        self.explain = explain
        self.rejections = rejections
        #: What arrived and is not handled yet: (topic, message).
        self.inbox: queue.Queue[tuple[str, Message]] = queue.Queue(maxsize=inbox_size)

    # -- sending ------------------------------------------------------------
    def send(self, topic: str, kind: Kind, *, meta: Mapping[str, Any] | None = None, body: bytes = b"",
             retain: bool = False) -> int:
        """Publish one message from the server; returns what the transport's ``publish`` returns."""
        msg = Message(kind, self.federation, SERVER_ID, self.round_of(), dict(meta or {}), body)
        return self.transport.publish(topic, msg, retain=retain)

    def command(self, cid: str, op: Op, **meta: Any) -> int:
        """Send the command ``op`` to the device ``cid`` (on its command topic), built by the vocabulary.

        Returns what :meth:`send` returns (the bytes sent, for the MQTT transport).
        """
        return self.send(self.topics.cmd(cid), Kind.CMD, meta=build(op, **meta))

    def broadcast(self, op: Op, **meta: Any) -> int:
        """Send the command ``op`` to every device (on the broadcast topic), built by the vocabulary.

        Returns what :meth:`send` returns (the bytes sent, for the MQTT transport).
        """
        return self.send(self.topics.broadcast(), Kind.CMD, meta=build(op, **meta))

    # -- receiving ----------------------------------------------------------
    def subscribe(self, leaves: Iterable[str]) -> None:
        """Put every message on the device topics ``clients/+/<leaf>`` in the inbox."""
        for leaf in leaves:
            self.transport.subscribe(self.topics.all_clients(leaf), self.enqueue)

    def enqueue(self, topic: str, msg: Message) -> None:
        """The transport's callback: queue the message (dropped, and counted, when the inbox is full)."""
        try:
            self.inbox.put_nowait((topic, msg))
        except queue.Full:
            self.reject("inbox-full", f"dropping {msg.kind.name}", msg.sender)

    def reject(self, reason: str, detail: str, sender: str = "?") -> None:
        """Count (and log) one refused message (through ``rejections``, which takes the sender second)."""
        self.rejections(reason, sender, detail)

    def pump(self, until: Callable[[], bool], timeout: float) -> bool:
        """Handle incoming messages until ``until()`` or the deadline; returns whether ``until`` held."""
        deadline = time.monotonic() + timeout
        while True:
            if until():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return until()
            try:
                topic, msg = self.inbox.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            self.handle_safely(topic, msg)

    def drain(self) -> int:
        """Handle the messages already in the inbox, without waiting for more; returns how many."""
        n = 0
        while True:
            try:
                topic, msg = self.inbox.get_nowait()
            except queue.Empty:
                return n
            self.handle_safely(topic, msg)
            n += 1

    def handle_safely(self, topic: str, msg: Message) -> None:
        """Handle one message; whatever it raises is a counted rejection, never the end of the server."""
        try:
            self.handler(topic, msg)
        except Exception as e:  # a bad message, or a handler bug a message could trigger: count it, keep serving
            reason, detail = self.explain(msg, e)
            if reason == "handler-error":
                log.debug("handler error on %s from %s", msg.kind.name, msg.sender, exc_info=True)
            self.reject(reason, detail, msg.sender)
