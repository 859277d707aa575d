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

A refused update is known to whoever waits for it: whether the transport
refused it before decoding (its sender is the one its topic names, which
the shipped ACL lets only that device write) or the handler refused it, the
link calls ``on_refused(sender, reason)`` on the driver's thread.

The driver brings its handler, the way it counts and logs rejections
(``rejections(reason, sender, detail)``, e.g. an :class:`edge_sdk.rejections.RejectionLog`),
the round it is in, and, if it words them otherwise than :func:`explain_rejection`,
how a handler's exception becomes a rejection's reason and detail.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Union

from edge_sdk.logs import log_context
from edge_sdk.protocol import SERVER_ID, Kind, Message, ProtocolError, Topics
from edge_sdk.protocol.commands import Op, build

__all__ = ["INBOX_SIZE", "Refused", "ServerLink", "explain_rejection", "new_run_id", "server_offline"]

#: Messages the inbox holds; past it a message is dropped (an ``inbox-full`` rejection).
INBOX_SIZE = 100_000

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refused:
    """A device's update the transport refused before it could be decoded (already counted and logged)."""

    #: The device whose topic it came on.
    sender: str
    reason: str


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


def new_run_id(clock: Callable[[], float] = time.time) -> str:
    """A fresh run's id: its start (UTC) and 6 random hex digits, e.g. ``20261125T021800-3fa9c1``."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(clock())) + "-" + secrets.token_hex(3)


def server_offline(federation: str, run_id: str | None = None) -> Message:
    """The server's status "offline" (its last will, and what it says when it leaves a run)."""
    return Message(Kind.STATUS, federation, SERVER_ID, 0,
                   {"state": "offline", **({"run": run_id} if run_id else {})})


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
    on_refused : callable, optional
        ``on_refused(sender, reason)``: a device's update was refused (by the transport or the handler).
    """

    def __init__(self, transport: Any, topics: Topics, federation: str, *,
                 handler: Callable[[str, Message], None], rejections: Callable[[str, str, str], None],
                 round_of: Callable[[], int] = lambda: 0,
                 explain: Callable[[Message, Exception], tuple[str, str]] = explain_rejection,
                 inbox_size: int = INBOX_SIZE, on_refused: Callable[[str, str], None] | None = None) -> None:
        self.transport = transport
        self.topics = topics
        self.federation = federation
        self.handler = handler
        self.round_of = round_of
        self.explain = explain
        self.rejections = rejections
        self.on_refused = on_refused
        #: The run last announced online (None before the first announcement).
        self.run_id: str | None = None
        #: What arrived and is not handled yet: (topic, message), or (topic, a refusal by the transport).
        self.inbox: queue.Queue[tuple[str, Union[Message, Refused]]] = queue.Queue(maxsize=inbox_size)
        self._listening = False
        #: Called on the driver's thread while it pumps, between messages and at least every 0.2 s (a watch's
        #: refresh, which keeps its own pace); whatever it raises is logged, never the end of the server.
        self.on_tick: Callable[[], None] | None = None

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

    def announce(self, run_id: str, *, online: bool = True, serving: bool = False) -> int:
        """Say on the server's status topic that run ``run_id`` is on (``serving``: its trained models are
        served), or that the server left it.

        A device in service mode joins each run announced online (see
        :func:`edge_sdk.client.commands.on_server_status`). Not
        retained: the shipped broker allows no retained message (a device could
        otherwise retain its own), and a device connecting later says hello on
        connecting anyway. The run announced online is :attr:`run_id`, which every
        welcome names too (an announcement that reaches a device after its welcome
        is then of a run it is in already).
        """
        if online:
            self.run_id = run_id
            log_context.set(run=run_id)  # in each log line from now on (--log-format json)
        meta: dict[str, Any] = {"state": "online" if online else "offline", "run": run_id}
        if serving:
            meta["serving"] = True
        if online and self.transport.will_name:  # the signed will, admitted by the devices whatever its age
            meta["will"] = self.transport.will_name
        return self.send(self.topics.server_status(), Kind.STATUS, meta=meta)

    def stop_devices(self, run_id: str, reason: str, *, failed: bool = False) -> None:
        """Tell every device that run ``run_id`` ended (``failed``: it could not finish, for ``reason``), then
        that the server left it."""
        if failed:
            self.broadcast(Op.STOP, reason=reason, failed=True, run=run_id)
        else:
            self.broadcast(Op.STOP, reason=reason, run=run_id)
        self.announce(run_id, online=False)

    def subscribe_aggregators(self) -> None:
        """Put every aggregator's receipts, partial sums and statuses (each (re)connection) in the inbox."""
        for leaf in ("receipt", "partial", "status"):
            self.transport.subscribe(self.topics.aggregator("+", leaf), self.enqueue)

    # -- receiving ----------------------------------------------------------
    def subscribe(self, leaves: Iterable[str]) -> None:
        """Put every message on the device topics ``clients/+/<leaf>`` in the inbox."""
        if self.on_refused is not None and not self._listening and hasattr(self.transport, "on_rejected"):
            self.transport.on_rejected(self._transport_refused)
            self._listening = True
        for leaf in leaves:
            self.transport.subscribe(self.topics.all_clients(leaf), self.enqueue)

    def _transport_refused(self, topic: str, reason: str, detail: str) -> None:
        """The transport's listener (its thread): a refused update, queued for the driver's thread."""
        parsed = self.topics.parse(topic)
        if parsed is None or parsed[0] != "clients" or parsed[2] != "update" or reason == "sender":
            return  # "sender": the envelope names another device than the topic: not the topic's device's doing
        try:
            self.inbox.put_nowait((topic, Refused(parsed[1], reason)))
        except queue.Full:
            pass  # already counted by the transport; the round's deadline still holds

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
            if self.on_tick is not None:
                self._tick()
            if until():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return until()
            try:
                topic, msg = self.inbox.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            self._dispatch(topic, msg)

    def _tick(self) -> None:
        try:
            self.on_tick()  # type: ignore[misc]
        except Exception:  # a watch's bug must not end the server
            log.exception("the watch's refresh failed")

    def drain(self) -> int:
        """Handle the messages already in the inbox, without waiting for more; returns how many."""
        n = 0
        while True:
            try:
                topic, msg = self.inbox.get_nowait()
            except queue.Empty:
                return n
            self._dispatch(topic, msg)
            n += 1

    def _dispatch(self, topic: str, item: Message | Refused) -> None:
        if isinstance(item, Refused):
            self._refused(item.sender, item.reason)
        else:
            self.handle_safely(topic, item)

    def _refused(self, sender: str, reason: str) -> None:
        if self.on_refused is None:
            return
        try:
            self.on_refused(sender, reason)
        except Exception:  # a driver bug must not end the server
            log.exception("on_refused failed for %s (%s)", sender, reason)

    def handle_safely(self, topic: str, msg: Message) -> None:
        """Handle one message; whatever it raises is a counted rejection, never the end of the server."""
        try:
            self.handler(topic, msg)
        except Exception as e:  # a bad message, or a handler bug a message could trigger: count it, keep serving
            reason, detail = self.explain(msg, e)
            if reason == "handler-error":
                log.debug("handler error on %s from %s", msg.kind.name, msg.sender, exc_info=True)
            self.reject(reason, detail, msg.sender)
            if msg.kind == Kind.UPDATE:
                self._refused(msg.sender, reason)
