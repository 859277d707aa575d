"""The receive path shared by both transports: validate, reassemble, count, route to the handlers."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..protocol import (
    BUSY,
    DEFAULT_CHUNK_DEADLINE,
    DEFAULT_CHUNK_MEMORY,
    DEFAULT_CHUNK_PENDING_PER_SENDER,
    DEFAULT_CHUNK_TIMEOUT,
    Kind,
    Message,
    ProtocolError,
    Reassembler,
    Topics,
    decode_message,
)
from ..rejections import RejectionLog
from .filters import topic_matches

__all__ = ["Delivery", "Handler", "Inbox", "Meter"]

log = logging.getLogger(__name__)

#: A subscription handler: called with the topic and the validated message.
Handler = Callable[[str, Message], None]


class Meter:
    """Thread-safe counters: messages, bytes and chunks per kind; rejections per reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent: dict[str, dict[str, int]] = {}
        self.received: dict[str, dict[str, int]] = {}
        self.rejected: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def add(self, table: dict[str, dict[str, int]], kind: str, *, messages: int = 0, nbytes: int = 0,
            chunks: int = 0) -> None:
        with self._lock:
            row = table.setdefault(kind, {"messages": 0, "bytes": 0, "chunks": 0})
            row["messages"] += messages
            row["bytes"] += nbytes
            row["chunks"] += chunks

    def bump(self, table: dict[str, int], key: str) -> None:
        with self._lock:
            table[key] = table.get(key, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "sent": {k: dict(v) for k, v in self.sent.items()},
                "received": {k: dict(v) for k, v in self.received.items()},
                "rejected": dict(self.rejected),
                "errors": dict(self.errors),
            }


#: One handler call an incoming message earns: the handler, the topic, the validated message.
Delivery = tuple[Handler, str, Message]


def _chunk_label(k: Any) -> str:
    """The kind a chunk announces, for byte counts ("CHUNK" when it names none)."""
    if isinstance(k, int) and not isinstance(k, bool):
        try:
            return Kind(k).name
        except ValueError:
            pass
    return "CHUNK"


def shared_filter(topic_filter: str) -> str:
    """The filter a shared subscription (``$share/<group>/<filter>``, MQTT 5 and Mosquitto) matches topics by."""
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        if len(parts) < 3 or not parts[1] or not parts[2]:
            raise ValueError(f"shared subscription {topic_filter!r} must be $share/<group>/<filter>")
        return parts[2]
    return topic_filter


class Inbox:
    """The receive path shared by both transports: validate, reassemble, route."""

    def __init__(
        self,
        topics: Topics,
        meter: Meter,
        max_message: int,
        *,
        chunk_timeout_s: float = DEFAULT_CHUNK_TIMEOUT,
        chunk_deadline_s: float = DEFAULT_CHUNK_DEADLINE,
        chunk_pending_per_sender: int = DEFAULT_CHUNK_PENDING_PER_SENDER,
        chunk_memory_bytes: int = DEFAULT_CHUNK_MEMORY,
        chunk_sender_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topics = topics
        self.meter = meter
        self.max_message = int(max_message)
        self._reassembler = Reassembler(
            max_total_bytes=chunk_memory_bytes,
            timeout_s=chunk_timeout_s,
            clock=clock,
            max_size=self.max_message,
            deadline_s=chunk_deadline_s,
            max_pending_per_sender=chunk_pending_per_sender,
            max_sender_bytes=chunk_sender_bytes,
        )
        self._lock = threading.Lock()
        self._subs: dict[str, tuple[int, list[Handler]]] = {}
        self._log = RejectionLog(log)
        #: Checks that every incoming envelope is signed by the server (a device's inbox), or None.
        self.verifier: Any = None
        #: The topic scopes the server's signature is checked on (None: every topic).
        self.verifier_scopes: frozenset[str] | None = None
        #: Called as ``listener(topic, reason, detail)`` after each refusal (:meth:`TransportBase.on_rejected`).
        self.reject_listeners: tuple[Callable[[str, str, str], None], ...] = ()
        #: The aggregators this side accepts, by id (a :class:`edge_sdk.signing.Verifier` each), or None
        #: when it accepts none: every message on ``aggregators/<id>/`` must be signed by ``<id>``'s key.
        self.aggregator_verifiers: dict[str, Any] | None = None
        #: ``router(topic, sender, payload) -> bool``: takes a chunk reassembled elsewhere (True), or None.
        self.chunk_router: Callable[[str, str, bytes], bool] | None = None

    def expire(self) -> int:
        """Drop stalled, overdue or cut partial transfers now; returns how many (thread-safe).

        An update dropped so (cut on the way, stalled, overdue) is refused as ``busy`` to the rejection
        listeners, on its sender's update topic, so that the server asks for it again.
        """
        with self._lock:  # the reassembler is not thread-safe
            n = self._reassembler.expire()
            lost, self._reassembler.lost = self._reassembler.lost, []
        for federation, sender, kind in lost:
            if federation == self.topics.federation and kind == Kind.UPDATE:
                self._reject(self.topics.update(sender), ProtocolError(
                    BUSY, f"an update from {sender} did not arrive whole; dropped, its sender is asked again"))
        return n

    def chunk_stats(self) -> dict[str, Any]:
        """The reassembler's counters (thread-safe)."""
        with self._lock:
            return self._reassembler.stats()

    def partials(self) -> int:
        """Chunked transfers in progress (a cheap look, for timers)."""
        return self._reassembler.pending()

    def add(self, topic_filter: str, handler: Handler, qos: int) -> None:
        shared_filter(topic_filter)  # a malformed $share/ filter is refused here
        with self._lock:
            old_qos, handlers = self._subs.get(topic_filter, (qos, []))
            self._subs[topic_filter] = (max(old_qos, qos), [*handlers, handler])

    def remove(self, topic_filter: str) -> bool:
        with self._lock:
            return self._subs.pop(topic_filter, None) is not None

    def filters(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(f, q) for f, (q, _) in self._subs.items()]

    def _reject(self, topic: str, err: ProtocolError) -> None:
        self.meter.bump(self.meter.rejected, err.reason)
        self._log(err.reason, topic, str(err))
        for listener in self.reject_listeners:
            try:
                listener(topic, err.reason, str(err))
            except Exception:  # a listener's bug must not break the receiving thread
                self.meter.bump(self.meter.errors, "listener")
                log.exception("rejection listener %r failed", listener)

    def process(self, topic: str, payload: bytes, retained: bool = False) -> list[Delivery]:
        """Validate one incoming payload; return the handler calls it earns (none when rejected).

        ``retained``: the broker delivered it from its retained store (on
        subscribing). FedSketch retains nothing but, at most, the server's
        own status: a retained message anywhere else (a device's hello, a
        command) is somebody's attempt to be replayed to every later server or
        device, and is refused (reason ``retained``).
        """
        if retained:
            parsed = self.topics.parse(topic)
            if parsed is None or parsed[0] != "server":
                self._reject(topic, ProtocolError("retained", "retained message ignored (FedSketch retains "
                                                              "nothing on this topic)"))
                return []
        check = {
            "max_size": self.max_message,
            "expected_sender": self.topics.required_sender(topic),
            "expected_federation": self.topics.federation,
        }
        try:
            msg = decode_message(payload, **check)
            verifier = self._verifier_for(topic)
            if verifier is not None:
                verifier.check(payload)
            if msg.kind == Kind.CHUNK:
                router = self.chunk_router
                if router is not None and router(topic, msg.sender, payload):
                    return []  # another process reassembles this sender's transfers
                label = _chunk_label(msg.meta.get("k"))
                with self._lock:  # the reassembler is not thread-safe
                    whole = self._reassembler.feed(msg)
                self.meter.add(self.meter.received, label, nbytes=len(payload), chunks=1)
                if whole is None:
                    return []
                inner = decode_message(whole, **check)
                if verifier is not None:
                    verifier.check(whole)
                if inner.kind == Kind.CHUNK:
                    raise ProtocolError("kind", "a chunked payload holds another CHUNK message")
                if inner.sender != msg.sender:
                    raise ProtocolError(
                        "sender", f"chunks from {msg.sender!r} carry a message from {inner.sender!r}"
                    )
                if label != "CHUNK" and inner.kind.name != label:
                    raise ProtocolError("chunk", f"chunks announced {label} but carry {inner.kind.name}")
                self.meter.add(self.meter.received, inner.kind.name, messages=1)
                msg = inner
            else:
                self.meter.add(self.meter.received, msg.kind.name, messages=1, nbytes=len(payload))
        except ProtocolError as e:
            self._reject(topic, e)
            return []
        with self._lock:
            subs = list(self._subs.items())
        return [(h, topic, msg) for f, (_, handlers) in subs if topic_matches(shared_filter(f), topic)
                for h in handlers]

    def _verifier_for(self, topic: str) -> Any:
        """The check of a message on ``topic``: its aggregator's key on ``aggregators/<id>/``, else the server's."""
        verifiers = self.aggregator_verifiers
        if verifiers is not None:
            parsed = self.topics.parse(topic)
            if parsed is not None and parsed[0] == "aggregators":
                verifier = verifiers.get(parsed[1])
                if verifier is None:
                    raise ProtocolError("unknown-aggregator",
                                        f"aggregator {parsed[1]!r} is not one whose public key this server holds")
                return verifier
        if self.verifier is not None and self.verifier_scopes is not None:
            parsed = self.topics.parse(topic)
            if parsed is None or parsed[0] not in self.verifier_scopes:
                return None
        return self.verifier

    def deliver(self, deliveries: list[Delivery]) -> None:
        for handler, topic, msg in deliveries:
            try:
                handler(topic, msg)
            except Exception:
                self.meter.bump(self.meter.errors, "handler")
                log.exception("handler %r failed on %s message from %s (topic %s)",
                              handler, msg.kind.name, msg.sender, topic)
