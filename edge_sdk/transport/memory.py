"""The in-memory twin for unit tests: :class:`MemoryBroker` and :class:`MemoryTransport`."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..protocol import DEFAULT_MAX_MESSAGE, Message
from .base import TransportBase
from .filters import check_filter, check_topic, topic_matches
from .inbox import Handler

__all__ = ["MemoryBroker", "MemoryTransport"]

log = logging.getLogger(__name__)


@dataclass
class _Session:
    client_id: str
    transport: MemoryTransport | None = None
    filters: set[str] = field(default_factory=set)
    queued: deque[tuple[str, bytes]] = field(default_factory=deque)


class MemoryBroker:
    """An in-process broker for unit tests: wildcards, retained messages, persistent sessions.

    Delivery is synchronous: :meth:`publish` returns after every connected
    subscriber's handlers ran. A subscriber that closed cleanly keeps its
    session, and messages for it wait (up to ``max_queued``) until it
    reconnects, like QoS 1 on a real broker. As on MQTT brokers, a second
    connection with a client id that is connected takes the session over
    and the first one stops receiving. There is no ACL: any transport may
    publish on any topic (to test what the receivers reject).
    """

    def __init__(self, max_queued: int = 10_000) -> None:
        self.max_queued = int(max_queued)
        self._lock = threading.RLock()
        self._sessions: dict[str, _Session] = {}
        self._retained: dict[str, bytes] = {}
        #: Every (topic, payload) published, in order (for assertions).
        self.log: list[tuple[str, bytes]] = []

    def __repr__(self) -> str:
        with self._lock:
            online = sum(s.transport is not None for s in self._sessions.values())
            return f"MemoryBroker(sessions={len(self._sessions)}, online={online}, retained={len(self._retained)})"

    def retained(self, topic: str) -> bytes | None:
        """The retained payload of a topic, if any."""
        with self._lock:
            return self._retained.get(topic)

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> int:
        """Deliver a raw payload; returns how many sessions got or queued it."""
        check_topic(topic)
        payload = bytes(payload)
        with self._lock:
            self.log.append((topic, payload))
            if retain:
                if payload:
                    self._retained[topic] = payload
                else:
                    self._retained.pop(topic, None)
            targets = []
            for s in self._sessions.values():
                if not any(topic_matches(f, topic) for f in s.filters):
                    continue
                if s.transport is not None:
                    targets.append(s.transport)
                else:
                    if len(s.queued) >= self.max_queued:
                        log.warning("session %s queue full: dropping its oldest message", s.client_id)
                        s.queued.popleft()
                    s.queued.append((topic, payload))
        for t in targets:
            t._receive(topic, payload)
        return len(targets)

    def _connect(self, transport: MemoryTransport, clean: bool) -> None:
        with self._lock:
            s = self._sessions.get(transport.client_id)
            if s is not None and s.transport is not None and s.transport is not transport:
                # MQTT session takeover: the newer connection with this client id wins
                log.warning("client id %s connected again: the earlier connection is dropped", transport.client_id)
                s.transport._drop()
            if s is None or clean:
                s = self._sessions[transport.client_id] = _Session(transport.client_id)
            s.transport = transport
            backlog = list(s.queued)
            s.queued.clear()
        for topic, payload in backlog:
            transport._receive(topic, payload)

    def _subscribe(self, client_id: str, topic_filter: str) -> None:
        with self._lock:
            s = self._sessions[client_id]
            s.filters.add(topic_filter)
            transport = s.transport
            retained = [(t, p) for t, p in self._retained.items() if topic_matches(topic_filter, t)]
        if transport is not None:
            for topic, payload in retained:
                transport._receive(topic, payload, retained=True)

    def _unsubscribe(self, client_id: str, topic_filter: str) -> None:
        with self._lock:
            s = self._sessions.get(client_id)
            if s is not None:
                s.filters.discard(topic_filter)

    def _disconnect(self, transport: MemoryTransport, will: tuple[str, bytes, bool] | None) -> None:
        with self._lock:
            s = self._sessions.get(transport.client_id)
            if s is not None and s.transport is transport:
                s.transport = None
        if will is not None:
            self.publish(will[0], will[1], retain=will[2])


class MemoryTransport(TransportBase):
    """:class:`MqttTransport`'s in-memory twin, sharing its validation and chunking.

    Parameters
    ----------
    broker : MemoryBroker
        The broker shared by the transports of one test.
    client_id, federation, root, will_topic, will_payload, will_retain
        As for :class:`MqttTransport`.
    max_payload, max_message : int
        As in :class:`BrokerConfig`.
    clean_session : bool
        Start with a fresh session instead of resuming the stored one.
    chunk_limits : mapping, optional
        The reassembler's limits, named as :class:`BrokerConfig`'s ``chunk_*``
        fields, and ``clock`` (a monotonic time source, for tests). Stalled
        transfers are dropped when a chunk arrives or on :meth:`expire_chunks`.
    """

    def __init__(
        self,
        broker: MemoryBroker,
        client_id: str,
        *,
        federation: str,
        root: str = "fedsketch",
        max_payload: int = 1_000_000,
        max_message: int = DEFAULT_MAX_MESSAGE,
        will_topic: str | None = None,
        will_payload: Message | bytes | None = None,
        will_retain: bool = False,
        clean_session: bool = False,
        chunk_limits: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(client_id, federation, root, max_payload, max_message, **dict(chunk_limits or {}))
        if (will_topic is None) != (will_payload is None):
            raise ValueError("will_topic and will_payload go together")
        self.broker = broker
        self.clean_session = clean_session
        self._will: tuple[str, bytes, bool] | None = None
        if will_topic is not None:
            self._will = (check_topic(will_topic), self._name_will(will_payload), will_retain)
        self._connected = threading.Event()

    def __repr__(self) -> str:
        return (f"MemoryTransport(client_id={self.client_id!r}, federation={self.federation!r}, "
                f"connected={self.is_connected})")

    @property
    def is_connected(self) -> bool:
        """Whether connected to the in-memory broker."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected; returns whether it is."""
        return self._connected.wait(timeout)

    def connect(self, timeout: float = 10.0) -> None:
        """Join the broker, renew subscriptions, receive what waited for this session."""
        if self.is_connected:
            return
        self._connected.set()
        self.broker._connect(self, self.clean_session)
        for topic_filter, _ in self._inbox.filters():
            self.broker._subscribe(self.client_id, topic_filter)
        self._notify_connected()

    def subscribe(self, topic_filter: str, handler: Handler, *, qos: int | None = None) -> None:
        """Route messages on ``topic_filter`` to ``handler(topic, message)``."""
        check_filter(topic_filter)
        self._inbox.add(topic_filter, handler, 1 if qos is None else qos)
        if self.is_connected:
            self.broker._subscribe(self.client_id, topic_filter)

    def unsubscribe(self, topic_filter: str) -> None:
        """Forget a filter and its handlers."""
        self._inbox.remove(topic_filter)
        self.broker._unsubscribe(self.client_id, topic_filter)

    def publish(self, topic: str, msg: Message, *, qos: int = 1, retain: bool = False, wait: bool = False,
                timeout: float = 60.0) -> int:
        """Send a message (chunked above ``max_payload``); returns the bytes sent."""
        if not self.is_connected:
            raise ConnectionError(f"{self.client_id} is not connected to the memory broker")
        frames = self._frames(topic, msg, retain)
        for frame in frames:
            self.broker.publish(topic, frame, retain=retain)
        return sum(map(len, frames))

    def publish_raw(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Put arbitrary bytes on the broker, bypassing the encoder (tests of rejections)."""
        self.broker.publish(topic, payload, retain=retain)

    def _receive(self, topic: str, payload: bytes, retained: bool = False) -> None:
        if self.is_connected:
            deliveries = self._inbox.process(topic, payload, retained)
            if deliveries:
                self._deliver(deliveries)

    def _drop(self) -> None:
        self._connected.clear()

    def expire_chunks(self) -> int:
        """Drop stalled or overdue partial transfers now (MqttTransport does it on a timer)."""
        return self._inbox.expire()

    def kill(self) -> None:
        """Lose the connection without a clean disconnect: the broker publishes the will."""
        if self.is_connected:
            self._connected.clear()
            self.broker._disconnect(self, self._will)

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect cleanly (no will); the session stays on the broker."""
        if self.is_connected:
            self._connected.clear()
            self.broker._disconnect(self, None)

    def __enter__(self) -> MemoryTransport:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

