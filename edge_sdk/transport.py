"""MQTT transport: the one module that owns paho, and its in-memory twin.

:class:`MqttTransport` wraps a paho-mqtt 2.x client (it never subclasses it
nor lets paho types escape): persistent sessions (clean_session false on
MQTT 3.1.1, clean_start false plus a session expiry on MQTT 5), QoS 1,
subscriptions remade on every connect so they survive reconnects, exponential
reconnect back-off, an optional last will, TLS for ``mqtts://``.

Incoming payloads go through one path, shared with :class:`MemoryTransport`:
:func:`~edge_sdk.protocol.decode_message` (on a ``clients/<id>/`` topic other
than ``cmd`` the sender must be ``<id>``; the federation must be ours), CHUNK
envelopes through a :class:`~edge_sdk.protocol.Reassembler`, then the
handlers. Rejections are logged and counted by reason, never raised into
the network thread. Outgoing messages above ``max_payload`` are chunked.
Bytes are counted per message kind in both directions (chunk traffic is
attributed to the kind it carries), which is how FedSketch measures
communication.

Handlers run on one dispatcher thread of the transport, not in paho's
network thread, so a slow handler does not stop keep-alives; still, hand
long work (training) to another thread and do not wait for a publish inside
a handler. :class:`MemoryTransport` calls handlers synchronously, in the
publisher's thread, which keeps unit tests deterministic.

A process that holds many connections (the fleet emulator) passes a shared
:class:`~edge_sdk.netloop.NetworkLoop` (``loop=``): then one thread runs the
sockets of every transport and a small pool runs their handlers, still in
order per transport (see :mod:`edge_sdk.netloop`). Without it, each
transport has its own threads, which is right for a device.
"""

from __future__ import annotations

import functools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol
from urllib.parse import urlsplit, urlunsplit

from .protocol import (
    DEFAULT_CHUNK_DEADLINE,
    DEFAULT_CHUNK_MEMORY,
    DEFAULT_CHUNK_PENDING_PER_SENDER,
    DEFAULT_CHUNK_TIMEOUT,
    DEFAULT_MAX_MESSAGE,
    SIGNATURE_TRAILER,
    Kind,
    Message,
    ProtocolError,
    Reassembler,
    Topics,
    check_id,
    decode_message,
    encode_message,
    split_payload,
)
from .rejections import RejectionLog

__all__ = [
    "BrokerConfig",
    "Handler",
    "MemoryBroker",
    "MemoryTransport",
    "MqttTransport",
    "Transport",
    "topic_matches",
]

log = logging.getLogger(__name__)

#: A subscription handler: called with the topic and the validated message.
Handler = Callable[[str, Message], None]

_SCHEMES = {"mqtt": (1883, False), "mqtts": (8883, True)}
_PROTOCOLS = ("3.1.1", "5")
#: Bytes an MQTT PUBLISH packet adds to its payload, besides the topic name:
#: fixed header (up to 5), topic length (2), packet id (2), MQTT 5 properties (1), margin.
_PUBLISH_OVERHEAD = 16
#: Seconds between two expiry passes over partial chunked transfers, while idle.
_EXPIRY_PERIOD_S = 1.0


# -- configuration ------------------------------------------------------------


@dataclass(frozen=True)
class BrokerConfig:
    """Where the broker is and how to talk to it.

    Parameters
    ----------
    url : str
        ``mqtt://host:port`` (default port 1883) or ``mqtts://host:port``
        (TLS, default port 8883). Credentials do not belong in the URL.
    username, password : str, optional
        Broker credentials (the ACL grants a client the topics of its user name).
    ca_certs, certfile, keyfile : str, optional
        TLS files: the CA bundle that signed the broker's certificate, and a
        client certificate and key when the broker asks for one. ``mqtts`` only.
    tls_insecure : bool
        Skip the check that the certificate names the host (testing only).
    protocol : {"3.1.1", "5"}
        MQTT version. Keep "3.1.1" for brokers that speak nothing else (amqtt).
    keepalive : int
        Seconds between keep-alive pings.
    max_payload : int
        Largest MQTT packet sent, topic and header included: larger messages
        are chunked. Keep it at or below the broker's limit.
    max_message : int
        Largest message accepted, after reassembly.
    session_expiry_s : int
        How long the broker keeps the session of a disconnected client
        (MQTT 5; for 3.1.1 the broker's configuration decides).
    reconnect_min_s, reconnect_max_s : float
        Exponential reconnect back-off: first and longest wait.
    chunk_timeout_s : float
        A partial chunked transfer that gets no chunk for this long is dropped
        (checked about once a second, even without traffic).
    chunk_deadline_s : float
        A chunked transfer not complete this long after its first chunk is
        dropped, even while chunks keep coming.
    chunk_pending_per_sender : int
        Most chunked transfers in progress per sender; more are refused
        (reason ``pending``) without touching the other senders' budget.
    chunk_memory_bytes : int
        Most bytes all partial transfers may declare together (reason
        ``oversized`` above it).
    chunk_sender_bytes : int, optional
        Most bytes the partial transfers of one sender may declare together
        (default: ``max_message``).
    """

    url: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    tls_insecure: bool = False
    protocol: str = "3.1.1"
    keepalive: int = 30
    max_payload: int = 1_000_000
    max_message: int = 300_000_000
    session_expiry_s: int = 3600
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    chunk_timeout_s: float = DEFAULT_CHUNK_TIMEOUT
    chunk_deadline_s: float = DEFAULT_CHUNK_DEADLINE
    chunk_pending_per_sender: int = DEFAULT_CHUNK_PENDING_PER_SENDER
    chunk_memory_bytes: int = DEFAULT_CHUNK_MEMORY
    chunk_sender_bytes: int | None = None

    def __post_init__(self) -> None:
        self._split()  # validates the URL
        if self.protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {self.protocol!r}")
        if not self.tls and (self.ca_certs or self.certfile or self.keyfile or self.tls_insecure):
            raise ValueError(
                f"url {self.url!r} is plain mqtt://: ca_certs, certfile, keyfile and "
                "tls_insecure need mqtts://"
            )
        if self.password is not None and self.username is None:
            raise ValueError("password given without a username")
        if not 1 <= int(self.keepalive) <= 65535:
            raise ValueError(f"keepalive must be in [1, 65535] seconds, got {self.keepalive!r}")
        if int(self.max_payload) < 1024:
            raise ValueError(f"max_payload must be at least 1024 bytes, got {self.max_payload!r}")
        if int(self.max_message) < int(self.max_payload):
            raise ValueError(
                f"max_message ({self.max_message}) must be at least max_payload ({self.max_payload})"
            )
        if not 0 <= int(self.session_expiry_s) <= 0xFFFFFFFF:
            raise ValueError(f"session_expiry_s must be in [0, 2**32), got {self.session_expiry_s!r}")
        if not 0 < float(self.reconnect_min_s) <= float(self.reconnect_max_s):
            raise ValueError(
                "reconnect_min_s must be positive and at most reconnect_max_s, got "
                f"{self.reconnect_min_s!r} and {self.reconnect_max_s!r}"
            )
        for name in ("chunk_timeout_s", "chunk_deadline_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("chunk_pending_per_sender", "chunk_memory_bytes", "chunk_sender_bytes"):
            v = getattr(self, name)
            if v is None and name == "chunk_sender_bytes":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    def _split(self) -> tuple[str, str, int]:
        try:
            parts = urlsplit(self.url)
        except (TypeError, ValueError) as e:
            raise ValueError(f"url {self.url!r} is not a URL: {e}") from None
        scheme = parts.scheme.lower()
        if scheme not in _SCHEMES:
            raise ValueError(f"url scheme must be 'mqtt' or 'mqtts', got {parts.scheme!r} in {self.url!r}")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"url {self.url!r} holds credentials: pass username and password separately")
        if not parts.hostname:
            raise ValueError(f"url {self.url!r} has no host")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"url {self.url!r} must be scheme://host:port with nothing after the port")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"port in url {self.url!r} must be an integer in [1, 65535]") from None
        if port is None:
            port = _SCHEMES[scheme][0]
        if not 1 <= port <= 65535:
            raise ValueError(f"port in url {self.url!r} must be an integer in [1, 65535]")
        return scheme, parts.hostname, port

    @staticmethod
    def add_arguments(parser: Any, *, defaults_in_help: bool = False) -> None:
        """Add the broker options every program takes (not ``--broker``, whose default each program sets).

        ``--username``, ``--password-file``, ``--ca-certs``, ``--certfile``,
        ``--keyfile``, ``--protocol``, ``--max-payload``; read back with
        :meth:`from_args`. ``defaults_in_help`` writes each default into its
        help (for a parser whose formatter does not).
        """
        tail = " (default: %(default)s)" if defaults_in_help else ""
        parser.add_argument("--username", metavar="USER",
                            help="MQTT user name (with use_username_as_clientid, also the client id)" + tail)
        parser.add_argument("--password-file", metavar="FILE", help="file holding the MQTT password" + tail)
        parser.add_argument("--ca-certs", metavar="PEM", help="CA bundle for mqtts:// (none: the system's CAs)" + tail)
        parser.add_argument("--certfile", metavar="PEM", help="client certificate for mutual TLS" + tail)
        parser.add_argument("--keyfile", metavar="PEM", help="its private key" + tail)
        parser.add_argument("--protocol", default="3.1.1", choices=["3.1.1", "5"], help="MQTT protocol version" + tail)
        parser.add_argument("--max-payload", type=int, default=1_000_000, metavar="BYTES",
                            help="largest MQTT packet sent, topic included; bigger messages go in chunks" + tail)

    @classmethod
    def from_args(cls, args: Any, url: str, **kw: Any) -> BrokerConfig:
        """The config of the options :meth:`add_arguments` added (the password read from its file)."""
        password = None
        if args.password_file:
            with open(args.password_file, encoding="utf-8") as f:
                password = f.read().strip()
        return cls.from_url(url, username=args.username, password=password, ca_certs=args.ca_certs,
                            certfile=args.certfile, keyfile=args.keyfile, protocol=args.protocol,
                            max_payload=args.max_payload, **kw)

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> BrokerConfig:
        """Build a config from a broker URL and keyword overrides.

        ``mqtt://user:secret@host`` is accepted here: the credentials move to
        ``username``/``password`` (keywords win) and leave the URL.

        Raises
        ------
        ValueError
            Naming the bad field: unknown scheme, bad port, unknown protocol...
        TypeError
            For a keyword that is not a field.
        """
        unknown = sorted(set(kw) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown BrokerConfig fields {unknown}")
        kw = {k: v for k, v in kw.items() if v is not None}
        try:
            parts = urlsplit(url)
            user, secret = parts.username, parts.password
        except (TypeError, ValueError) as e:
            raise ValueError(f"url {url!r} is not a URL: {e}") from None
        if user is not None or secret is not None:
            netloc = parts.netloc.rpartition("@")[2]
            url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
            kw.setdefault("username", user)
            if secret is not None:
                kw.setdefault("password", secret)
        if "protocol" in kw:
            kw["protocol"] = str(kw["protocol"])
        return cls(url=url, **kw)

    @property
    def host(self) -> str:
        """Broker host name or address."""
        return self._split()[1]

    @property
    def port(self) -> int:
        """Broker port."""
        return self._split()[2]

    @property
    def tls(self) -> bool:
        """Whether the URL asks for TLS (``mqtts``)."""
        return _SCHEMES[self._split()[0]][1]


# -- topic matching, counting, dispatching -------------------------------------


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether an MQTT topic matches a subscription filter (``+`` and ``#``).

    ``a/#`` also matches ``a``; wildcards at the first level do not match
    topics that start with ``$``.
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return i == len(f_levels) - 1
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


def _check_filter(topic_filter: str) -> str:
    if not isinstance(topic_filter, str) or not topic_filter:
        raise ValueError(f"topic filter must be a non-empty string, got {topic_filter!r}")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"'#' must be a whole last level in filter {topic_filter!r}")
        if "+" in level and level != "+":
            raise ValueError(f"'+' must be a whole level in filter {topic_filter!r}")
    return topic_filter


def _check_topic(topic: str) -> str:
    if not isinstance(topic, str) or not topic or "+" in topic or "#" in topic:
        raise ValueError(f"publish topic must be a non-empty string without wildcards, got {topic!r}")
    return topic


class _Meter:
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


_Delivery = tuple[Handler, str, Message]


def _chunk_label(k: Any) -> str:
    """The kind a chunk announces, for byte counts ("CHUNK" when it names none)."""
    if isinstance(k, int) and not isinstance(k, bool):
        try:
            return Kind(k).name
        except ValueError:
            pass
    return "CHUNK"


class _Inbox:
    """The receive path shared by both transports: validate, reassemble, route."""

    def __init__(
        self,
        topics: Topics,
        meter: _Meter,
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

    def expire(self) -> int:
        """Drop stalled or overdue partial transfers now; returns how many (thread-safe)."""
        with self._lock:  # the reassembler is not thread-safe
            return self._reassembler.expire()

    def chunk_stats(self) -> dict[str, Any]:
        """The reassembler's counters (thread-safe)."""
        with self._lock:
            return self._reassembler.stats()

    def partials(self) -> int:
        """Chunked transfers in progress (a cheap look, for timers)."""
        return self._reassembler.pending()

    def add(self, topic_filter: str, handler: Handler, qos: int) -> None:
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

    def process(self, topic: str, payload: bytes, retained: bool = False) -> list[_Delivery]:
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
            if self.verifier is not None:
                self.verifier.check(payload)
            if msg.kind == Kind.CHUNK:
                label = _chunk_label(msg.meta.get("k"))
                with self._lock:  # the reassembler is not thread-safe
                    whole = self._reassembler.feed(msg)
                self.meter.add(self.meter.received, label, nbytes=len(payload), chunks=1)
                if whole is None:
                    return []
                inner = decode_message(whole, **check)
                if self.verifier is not None:
                    self.verifier.check(whole)
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
        return [(h, topic, msg) for f, (_, handlers) in subs if topic_matches(f, topic) for h in handlers]

    def deliver(self, deliveries: list[_Delivery]) -> None:
        for handler, topic, msg in deliveries:
            try:
                handler(topic, msg)
            except Exception:
                self.meter.bump(self.meter.errors, "handler")
                log.exception("handler %r failed on %s message from %s (topic %s)",
                              handler, msg.kind.name, msg.sender, topic)


class Transport(Protocol):
    """What the client and the server need from a transport."""

    client_id: str
    federation: str
    topics: Topics

    @property
    def is_connected(self) -> bool: ...

    def connect(self, timeout: float = 10.0) -> None: ...

    def wait_connected(self, timeout: float | None = None) -> bool: ...

    def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None: ...

    def on_connected(self, listener: Callable[[], None]) -> None: ...

    def publish(self, topic: str, msg: Message, *, qos: int = 1, retain: bool = False,
                wait: bool = False) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class _TransportBase:
    """Shared state and the send-side encoding and chunking."""

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
        self._meter = _Meter()
        self._signer: Any = None
        self._connect_listeners: tuple[Callable[[], None], ...] = ()
        self._delivery_listeners: tuple[Callable[[], None], ...] = ()
        self._inbox = _Inbox(self.topics, self._meter, self.max_message, **chunk_limits)

    def on_connected(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every (re)connection, once the subscriptions are renewed.

        It runs in the network thread: it must not block (enqueue work, or
        publish without waiting). A device re-announces itself with it.
        """
        self._connect_listeners = (*self._connect_listeners, listener)

    def on_delivered(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after the handlers of each incoming message ran, in the thread that ran them.

        For a driver that polls many clients (the fleet emulator): it learns
        that one of them has work without a thread waiting on each.
        """
        self._delivery_listeners = (*self._delivery_listeners, listener)

    def _deliver(self, deliveries: list[_Delivery]) -> None:
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

    def verify_with(self, verifier: Any) -> None:
        """Refuse every incoming envelope not signed by the server (a device's,
        :class:`edge_sdk.signing.Verifier`): reasons ``unsigned``, ``signature``, ``stale``, ``replay``."""
        self._inbox.verifier = verifier

    def _frames(self, topic: str, msg: Message, retain: bool) -> list[bytes]:
        _check_topic(topic)
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


# -- the real thing -----------------------------------------------------------


class MqttTransport(_TransportBase):
    """A paho-mqtt 2.x client speaking the FedSketch protocol.

    Parameters
    ----------
    config : BrokerConfig
        Broker address, credentials, TLS, limits.
    client_id : str
        MQTT client id; also the id this side speaks as (use the broker user
        name, which the ACL ties to ``clients/<id>/``).
    federation : str
        Federation whose topics are used and whose messages are accepted.
    root : str
        Topic root.
    will_topic : str, optional
        Last-will topic, published by the broker if the connection is lost
        without a clean disconnect (usually ``topics.status(client_id)``).
    will_payload : Message or bytes, optional
        The last will: a :class:`Message` (encoded here) or an encoded one.
    will_retain : bool
        Retain the will on the broker.
    dispatch_queue : int
        Validated messages waiting for the handler thread; when full, paho's
        network thread waits (back-pressure to the broker). Not used with
        ``loop``.
    loop : NetworkLoop, optional
        Run this connection on a shared :class:`~edge_sdk.netloop.NetworkLoop`
        (many connections per process) instead of its own network and
        dispatcher threads. Reconnections then wait a randomised back-off
        (half to all of the exponential delay), so that a fleet that lost
        its broker does not come back in one instant. Messages wait for the
        loop's pool without bound (no back-pressure to the broker).
    """

    def __init__(
        self,
        config: BrokerConfig,
        client_id: str,
        *,
        federation: str,
        root: str = "fedsketch",
        will_topic: str | None = None,
        will_payload: Message | bytes | None = None,
        will_retain: bool = False,
        dispatch_queue: int = 1000,
        loop: Any = None,
    ) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        super().__init__(client_id, federation, root, config.max_payload, config.max_message,
                         chunk_timeout_s=config.chunk_timeout_s, chunk_deadline_s=config.chunk_deadline_s,
                         chunk_pending_per_sender=config.chunk_pending_per_sender,
                         chunk_memory_bytes=config.chunk_memory_bytes,
                         chunk_sender_bytes=config.chunk_sender_bytes)
        self.config = config
        v5 = config.protocol == "5"
        kwargs: dict[str, Any] = {"client_id": self.client_id,
                                  "protocol": mqtt.MQTTv5 if v5 else mqtt.MQTTv311}
        if not v5:
            kwargs["clean_session"] = False
        client = mqtt.Client(CallbackAPIVersion.VERSION2, **kwargs)
        client.enable_logger(logging.getLogger(__name__ + ".paho"))
        if config.username is not None:
            client.username_pw_set(config.username, config.password)
        if config.tls:
            client.tls_set(ca_certs=config.ca_certs, certfile=config.certfile, keyfile=config.keyfile)
            if config.tls_insecure:
                client.tls_insecure_set(True)
        client.reconnect_delay_set(config.reconnect_min_s, config.reconnect_max_s)
        if (will_topic is None) != (will_payload is None):
            raise ValueError("will_topic and will_payload go together")
        if will_topic is not None:
            payload = encode_message(will_payload) if isinstance(will_payload, Message) else bytes(will_payload)
            client.will_set(_check_topic(will_topic), payload, qos=1, retain=will_retain)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        self._client = client
        self._v5 = v5
        self._connected = threading.Event()
        self._connack = threading.Event()
        self._refused: str | None = None
        self._closing = False
        self._stopping = False
        self._started = False
        self._acks = threading.Condition()
        self._unacked: set[int] = set()
        self._early_acks: set[int] = set()
        self._queue: queue.Queue[list[_Delivery] | None] = queue.Queue(maxsize=dispatch_queue)
        self._worker: threading.Thread | None = None
        self._loop = loop
        self._lane = loop.pool.lane(self.client_id) if loop is not None else None
        #: With a loop: whether the connection is wanted (reconnect after a loss), and failed attempts in a row.
        self._want = False
        self._attempts = 0
        self._next_expiry = 0.0
        self._gone = threading.Event()

    def __repr__(self) -> str:
        return (f"MqttTransport(url={self.config.url!r}, client_id={self.client_id!r}, "
                f"federation={self.federation!r}, connected={self.is_connected})")

    # -- paho callbacks (network thread) --
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._refused = str(reason_code)
            log.error("broker %s refused %s: %s", self.config.url, self.client_id, reason_code)
            self._connack.set()
            return
        self._refused = None
        self._attempts = 0
        self._connected.set()
        self._connack.set()
        filters = self._inbox.filters()
        if filters:
            client.subscribe(filters)
        log.info("connected to %s as %s (session present: %s, %d subscriptions)", self.config.url,
                 self.client_id, bool(getattr(flags, "session_present", False)), len(filters))
        self._notify_connected()

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        log.debug("connection attempt to %s failed; retrying with back-off", self.config.url)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self._connected.clear()
        self._gone.set()
        if self._closing or self._stopping:
            log.info("disconnected from %s", self.config.url)
        else:
            self._meter.bump(self._meter.errors, "connection-lost")
            log.warning("lost connection to %s (%s); reconnecting with back-off", self.config.url, reason_code)
            if self._loop is not None and self._want:
                self._retry_later()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        if self._lane is not None:  # validated and handled on the loop's pool, in order
            self._loop.submit(self._lane, functools.partial(
                self._receive, message.topic, message.payload, bool(getattr(message, "retain", False))))
            return
        try:
            deliveries = self._inbox.process(message.topic, message.payload, bool(getattr(message, "retain", False)))
        except Exception:  # never raise into paho's thread
            self._meter.bump(self._meter.errors, "receive")
            log.exception("failed to process a message on %s", getattr(message, "topic", "?"))
            return
        while deliveries and not self._closing:
            try:
                self._queue.put(deliveries, timeout=0.5)
                break
            except queue.Full:
                log.warning("handlers are behind: %d messages waiting", self._queue.qsize())

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        if getattr(reason_code, "is_failure", False):
            self._meter.bump(self._meter.errors, "publish")
            log.warning("broker did not accept message %d: %s", mid, reason_code)
        with self._acks:
            if mid in self._unacked:
                self._unacked.discard(mid)
            else:
                self._early_acks.add(mid)
            self._acks.notify_all()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        for rc in reason_codes:
            if rc.is_failure:
                self._meter.bump(self._meter.errors, "subscribe")
                log.warning("broker refused a subscription of %s: %s", self.client_id, rc)

    def _receive(self, topic: str, payload: bytes, retained: bool) -> None:
        """With a loop: validate and deliver one message (on the loop's pool)."""
        if self._closing:
            return
        try:
            deliveries = self._inbox.process(topic, payload, retained)
        except Exception:
            self._meter.bump(self._meter.errors, "receive")
            log.exception("failed to process a message on %s", topic)
            return
        if deliveries:
            self._deliver(deliveries)

    # -- with a loop: connecting, reconnecting, timers (network thread) --
    def _try_connect(self) -> None:
        if not self._want or self._closing or self._client.socket() is not None:
            return
        try:
            self._client.reconnect()
        except (OSError, ValueError) as e:
            self._attempts += 1
            log.debug("connection attempt %d of %s to %s failed (%s); retrying with back-off", self._attempts,
                      self.client_id, self.config.url, e)
            self._retry_later()

    def _retry_later(self) -> None:
        lo, hi = float(self.config.reconnect_min_s), float(self.config.reconnect_max_s)
        delay = min(hi, lo * 2 ** min(self._attempts, 30)) * random.uniform(0.5, 1.0)
        self._loop.call_later(delay, self._try_connect)

    def _tick(self) -> None:
        """Called by the loop about once a second: expiry of stalled chunked transfers."""
        if self._inbox.partials() and time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + _EXPIRY_PERIOD_S
            self._loop.submit(self._lane, self._expire)

    def _expire(self) -> None:
        try:
            self._inbox.expire()
        except Exception:
            self._meter.bump(self._meter.errors, "expire")
            log.exception("expiring partial transfers failed")

    # -- dispatcher thread --
    def _dispatch(self) -> None:
        # Also the timer that frees stalled partial transfers when no chunk comes.
        next_expiry = time.monotonic() + _EXPIRY_PERIOD_S
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_expiry - time.monotonic()))
            except queue.Empty:
                item = []
            if item is None:
                return
            if time.monotonic() >= next_expiry:
                try:
                    self._inbox.expire()
                except Exception:  # keep the dispatcher alive
                    self._meter.bump(self._meter.errors, "expire")
                    log.exception("expiring partial transfers failed")
                next_expiry = time.monotonic() + _EXPIRY_PERIOD_S
            if item:
                self._deliver(item)

    # -- public API --
    @property
    def is_connected(self) -> bool:
        """Whether the broker has accepted the connection and it is up."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected (again); returns whether it is."""
        return self._connected.wait(timeout)

    def connect(self, timeout: float = 10.0, *, wait: bool = True) -> None:
        """Connect and start the network thread; block until the broker answers.

        After this returns, lost connections are retried in the background
        with exponential back-off, and subscriptions are renewed.

        Parameters
        ----------
        timeout : float
            Seconds to wait for the broker's answer.
        wait : bool
            With ``False`` (a transport on a :class:`~edge_sdk.netloop.NetworkLoop`
            only), return at once: the connection is made, and retried with
            back-off, in the background; :meth:`wait_connected` waits for it.

        Raises
        ------
        ConnectionError
            When the broker refuses (bad credentials: "Not authorized") or
            does not answer within ``timeout`` seconds.
        """
        if not wait and self._loop is None:
            raise ValueError("connect(wait=False) needs a transport on a NetworkLoop (loop=...)")
        if self._closing:
            raise ConnectionError("transport is closed")
        if self._started:
            if not self._connected.wait(timeout):
                raise ConnectionError(f"not reconnected to {self.config.url} within {timeout:g} s")
            return
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        kwargs: dict[str, Any] = {}
        if self._v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = int(self.config.session_expiry_s)
            kwargs = {"clean_start": False, "properties": props}
        self._connack.clear()
        self._client.connect_async(self.config.host, self.config.port, int(self.config.keepalive), **kwargs)
        if self._loop is not None:
            self._loop.attach(self, self._client)
            self._want = True
            self._started = True
            self._loop.call_soon(self._try_connect)
            if not wait:
                return
        else:
            self._client.loop_start()
            self._started = True
        if self._worker is None and self._loop is None:
            self._worker = threading.Thread(target=self._dispatch, name=f"fedsketch-{self.client_id}",
                                            daemon=True)
            self._worker.start()
        if not self._connack.wait(timeout):
            self._stop_network()
            raise ConnectionError(
                f"no answer from broker {self.config.url} within {timeout:g} s "
                "(is it running, and is the address reachable?)"
            )
        if self._refused is not None:
            reason = self._refused
            self._stop_network(refused=True)
            raise ConnectionError(f"broker {self.config.url} refused {self.client_id}: {reason}")

    def _stop_network(self, *, refused: bool = False, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._loop is not None:
            self._want = False
            try:
                self._gone.clear()
                connected = self._client.socket() is not None
                self._client.disconnect()  # the loop writes it, then paho closes the socket there
                if connected and self._loop.running and not self._loop.in_loop():
                    self._gone.wait(timeout)
                self._loop.detach(self._client)  # after the close, in the loop's thread
            finally:
                self._stopping = False
                self._started = False
                self._connected.clear()
            return
        try:
            if refused:  # stop the retries first: the broker said no
                self._client.loop_stop()
                self._client.disconnect()
            else:
                self._client.disconnect()
                self._client.loop_stop()
        finally:
            self._stopping = False
            self._started = False
            self._connected.clear()

    def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None:
        """Route messages on ``topic_filter`` to ``handler(topic, message)``.

        May be called before :meth:`connect`; the subscription is (re)made on
        every connect. Avoid overlapping filters: a broker may deliver a
        message once per matching subscription.
        """
        _check_filter(topic_filter)
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
        self._inbox.add(topic_filter, handler, qos)
        if self._connected.is_set():
            self._client.subscribe(topic_filter, qos)

    def unsubscribe(self, topic_filter: str) -> None:
        """Forget a filter and its handlers."""
        if self._inbox.remove(topic_filter) and self._connected.is_set():
            self._client.unsubscribe(topic_filter)

    def publish(self, topic: str, msg: Message, *, qos: int = 1, retain: bool = False, wait: bool = False,
                timeout: float = 60.0) -> int:
        """Send a message (chunked above ``max_payload``); returns the bytes sent.

        While disconnected, QoS 1 messages are queued by paho and sent after
        reconnecting. With ``wait`` this blocks until the broker acknowledged
        every chunk (or raises ``TimeoutError`` after ``timeout`` seconds).
        """
        import paho.mqtt.client as mqtt

        if self._closing:
            raise ConnectionError("transport is closed")
        frames = self._frames(topic, msg, retain)
        mids = []
        for frame in frames:
            info = self._client.publish(topic, frame, qos=qos, retain=retain)
            if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                raise ConnectionError(f"paho could not queue a message on {topic}: {mqtt.error_string(info.rc)}")
            with self._acks:
                if info.mid in self._early_acks:
                    self._early_acks.discard(info.mid)
                else:
                    self._unacked.add(info.mid)
            mids.append(info.mid)
        if wait:
            self._wait_acks(set(mids), timeout)
        return sum(map(len, frames))

    def _wait_acks(self, mids: set[int] | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._acks:
            while True:
                left = self._unacked if mids is None else (mids & self._unacked)
                if not left:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if mids is not None:
                        raise TimeoutError(f"{len(left)} message(s) not acknowledged within {timeout:g} s")
                    return False
                self._acks.wait(min(remaining, 0.5))

    def close(self, timeout: float = 5.0) -> None:
        """Flush unacknowledged messages (up to ``timeout`` s), disconnect cleanly, stop threads.

        A clean disconnect does not trigger the last will.
        """
        if self._closing:
            return
        if self._started and self._connected.is_set() and not self._wait_acks(None, timeout):
            log.warning("closing with %d unacknowledged message(s)", len(self._unacked))
        self._closing = True
        if self._started:
            self._stop_network(timeout=timeout)
        if self._worker is not None:
            self._queue.put(None)
            if self._worker is not threading.current_thread():
                self._worker.join(timeout)
            self._worker = None

    def __enter__(self) -> MqttTransport:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- in-memory twin -------------------------------------------------------------


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
        _check_topic(topic)
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


class MemoryTransport(_TransportBase):
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
            payload = encode_message(will_payload) if isinstance(will_payload, Message) else bytes(will_payload)
            self._will = (_check_topic(will_topic), payload, will_retain)
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

    def subscribe(self, topic_filter: str, handler: Handler, *, qos: int = 1) -> None:
        """Route messages on ``topic_filter`` to ``handler(topic, message)``."""
        _check_filter(topic_filter)
        self._inbox.add(topic_filter, handler, qos)
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

