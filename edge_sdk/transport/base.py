"""What every transport is: the :class:`Transport` interface, and the state and send side both transports share."""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from ..protocol import (
    SIGNATURE_TRAILER,
    Message,
    ProtocolError,
    Topics,
    check_id,
    encode_message,
    split_payload,
)
from ..signing import signature_id
from .filters import check_topic
from .inbox import Delivery, Handler, Inbox, Meter

__all__ = ["Transport", "TransportBase"]

log = logging.getLogger(__name__)

#: Bytes an MQTT PUBLISH packet adds to its payload, besides the topic name:
#: fixed header (up to 5), topic length (2), packet id (2), MQTT 5 properties (1), margin.
_PUBLISH_OVERHEAD = 16


class Transport(Protocol):
    """What the client and the server need from a transport."""

    client_id: str
    federation: str
    topics: Topics

    @property
    def is_connected(self) -> bool: ...

    def connect(self, timeout: float = 10.0) -> None: ...

    def wait_connected(self, timeout: float | None = None) -> bool: ...

    def subscribe(self, topic_filter: str, handler: Handler, *, qos: int | None = None) -> None: ...

    def on_connected(self, listener: Callable[[], None]) -> None: ...

    def publish(self, topic: str, msg: Message, *, qos: int = 1, retain: bool = False,
                wait: bool = False) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class TransportBase:
    """Shared state and the send-side encoding and chunking: the base of both transports."""

    def __init__(self, client_id: str, federation: str, root: str, max_payload: int,
                 max_message: int, **chunk_limits: Any) -> None:
        try:
            self.client_id = check_id(client_id, "client_id")
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        self.topics = Topics(root, federation)
        self.federation = self.topics.federation
        self.max_payload = int(max_payload)
        self.max_message = int(max_message)
        self._meter = Meter()
        self._signer: Any = None
        self._connect_listeners: tuple[Callable[[], None], ...] = ()
        self._delivery_listeners: tuple[Callable[[], None], ...] = ()
        self._inbox = Inbox(self.topics, self._meter, self.max_message, **chunk_limits)
        #: The name of this transport's signed last will (:func:`edge_sdk.signing.signature_id`), which the
        #: server's run announcements give; None without a will, or with an unsigned one.
        self.will_name: str | None = None

    def _name_will(self, will: Message | bytes | None) -> bytes | None:
        """The will's bytes (encoded here if a :class:`Message`), and :attr:`will_name` set from them."""
        if will is None:
            return None
        payload = encode_message(will) if isinstance(will, Message) else bytes(will)
        self.will_name = signature_id(payload)
        return payload

    def on_connected(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every (re)connection, once the subscriptions are renewed.

        It runs in the network thread: it must not block (enqueue work, or
        publish without waiting). A device re-announces itself with it.
        """
        self._connect_listeners = (*self._connect_listeners, listener)

    def on_rejected(self, listener: Callable[[str, str, str], None]) -> None:
        """Call ``listener(topic, reason, detail)`` for every incoming message this transport refuses.

        The refusal is already counted (``stats()["rejected"]``) and logged;
        the listener learns whose topic it came on. A server's round uses it
        to stop waiting for a device whose update could not be decoded. It
        runs in the receiving thread: it must not block (enqueue, and return).
        """
        self._inbox.reject_listeners = (*self._inbox.reject_listeners, listener)

    def on_delivered(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after the handlers of each incoming message ran, in the thread that ran them.

        For a driver that polls many clients (the fleet emulator): it learns
        that one of them has work without a thread waiting on each.
        """
        self._delivery_listeners = (*self._delivery_listeners, listener)

    def _deliver(self, deliveries: list[Delivery]) -> None:
        self._inbox.deliver(deliveries)
        for listener in self._delivery_listeners:
            try:
                listener()
            except Exception:
                self._meter.bump(self._meter.errors, "listener")
                log.exception("delivery listener %r failed", listener)

    def _notify_connected(self) -> None:
        for listener in self._connect_listeners:
            try:
                listener()
            except Exception:  # a listener's bug must not break the connection
                self._meter.bump(self._meter.errors, "listener")
                log.exception("connect listener %r failed", listener)

    def sign_with(self, signer: Any) -> None:
        """Sign every envelope this transport sends (the server's, :class:`edge_sdk.signing.Signer`)."""
        self._signer = signer

    def verify_with(self, verifier: Any, *, scopes: Any = None) -> None:
        """Refuse every incoming envelope not signed by the server (a device's,
        :class:`edge_sdk.signing.Verifier`): reasons ``unsigned``, ``signature``, ``stale``, ``replay``.

        ``scopes``: only on topics of these scopes (an aggregator checks the
        server's ``aggregation`` messages, not the devices' updates)."""
        self._inbox.verifier = verifier
        self._inbox.verifier_scopes = None if scopes is None else frozenset(scopes)

    def admit_signed(self, name: str) -> None:
        """With a verifier (:meth:`verify_with`): accept the signed envelope named ``name`` once, whatever its
        age (:meth:`edge_sdk.signing.Verifier.admit`: the server's last will, named by its announcement)."""
        if self._inbox.verifier is not None:
            self._inbox.verifier.admit(name)

    def accept_aggregators(self, verifiers: Any) -> None:
        """Accept messages on ``aggregators/<id>/`` only signed by ``<id>``'s key (``{id: Verifier}``).

        Without this call no aggregator is accepted on those topics (their
        messages are never delivered to a handler that reads them). An
        unknown id is refused with reason ``unknown-aggregator``; a bad
        signature, a stale or replayed one as :meth:`verify_with` refuses them.
        """
        self._inbox.aggregator_verifiers = dict(verifiers)

    def route_chunks(self, router: Callable[[str, str, bytes], bool] | None) -> None:
        """Give each incoming chunk to ``router(topic, sender, payload)`` first: True means it took it.

        Ingest workers on one shared subscription each get some of a chunked
        transfer's chunks; the router hands a chunk to the worker that owns its
        sender, which feeds it to :meth:`inject`.
        """
        self._inbox.chunk_router = router

    def inject(self, topic: str, payload: bytes) -> None:
        """Process a frame another process received for this one, as if it came from the broker."""
        self._deliver(self._inbox.process(topic, payload))

    def _frames(self, topic: str, msg: Message, retain: bool) -> list[bytes]:
        check_topic(topic)
        payload = encode_message(msg)
        signer = self._signer
        if signer is not None:
            payload = signer.sign(payload)
        if len(payload) > self.max_message:
            raise ValueError(
                f"{msg.kind.name} message of {len(payload)} bytes exceeds max_message={self.max_message}"
            )
        budget = self.max_payload - len(topic.encode("utf-8")) - _PUBLISH_OVERHEAD
        if signer is not None:
            budget -= SIGNATURE_TRAILER
        frames = split_payload(payload, max_payload=budget, federation=msg.federation, sender=msg.sender,
                               round=msg.round)
        if signer is not None and len(frames) > 1:  # each chunk signed too: a forged chunk spoils nothing
            frames = [signer.sign(f) for f in frames]
        if retain and len(frames) > 1:
            raise ValueError(f"cannot retain a {len(payload)}-byte message: it needs {len(frames)} chunks")
        self._meter.add(self._meter.sent, msg.kind.name, messages=1, nbytes=sum(map(len, frames)),
                        chunks=len(frames) if len(frames) > 1 else 0)
        return frames

    def stats(self) -> dict[str, Any]:
        """Counters since creation.

        Returns
        -------
        dict
            ``{"sent": {kind: {"messages", "bytes", "chunks"}}, "received":
            {...}, "rejected": {reason: count}, "errors": {what: count},
            "chunks": {...}}``. Bytes are MQTT payload bytes; chunked
            messages count under the kind they carry. ``chunks`` holds the
            reassembler's state and counters: ``pending`` transfers, their
            declared ``pending_bytes``, the ``held_bytes`` received so far,
            transfers ``expired`` (idle) and ``expired_deadline``, and
            ``refused`` chunks per reason.
        """
        return {**self._meter.snapshot(), "chunks": self._inbox.chunk_stats()}

    @property
    def rejected(self) -> dict[str, int]:
        """Rejected incoming messages per reason."""
        return self._meter.snapshot()["rejected"]
