"""The broker's address, credentials, TLS files and limits: :class:`BrokerConfig`, and its command-line options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..protocol import (
    DEFAULT_CHUNK_DEADLINE,
    DEFAULT_CHUNK_MEMORY,
    DEFAULT_CHUNK_PENDING_PER_SENDER,
    DEFAULT_CHUNK_TIMEOUT,
)
from ..validation import check_choice

__all__ = ["BrokerConfig"]

_SCHEMES = {"mqtt": (1883, False), "mqtts": (8883, True)}
_PROTOCOLS = ("3.1.1", "5")


@dataclass(frozen=True)
class BrokerConfig:
    """Where the broker is and how to talk to it.

    Parameters
    ----------
    url : str
        ``mqtt://host:port`` (default port 1883) or ``mqtts://host:port``
        (TLS, default port 8883), or a comma-separated list of them (the
        nodes of a broker cluster, all with the same scheme): the transport
        connects to the first and, each time the connection is lost or an
        attempt fails, tries the next one, round the list. Credentials do not
        belong in the URL. :attr:`host`, :attr:`port` and :attr:`tls` are the
        first broker's; :attr:`urls` and :attr:`endpoints` list them all.
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
    subscribe_qos : {1, 0}
        The QoS of this client's subscriptions. 1: the broker keeps what comes
        for it while it is away (its session). 0: nothing is kept; on a NATS
        cluster a QoS 1 subscription is a JetStream consumer replicated on
        the nodes, which limits how fast a fleet connects, and a QoS 0 one is
        a plain NATS subscription. The server re-asks the updates a round
        waits for when a connection comes back; a device that missed its
        command while away is a straggler of that round.
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
        Most bytes all partial transfers may declare together: a transfer
        that does not fit beside the others is refused as ``busy`` (the
        server asks its sender for it again later), one larger alone as
        ``oversized``.
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
    subscribe_qos: int = 1

    def __post_init__(self) -> None:
        self._split_all()  # validates every URL of the list
        check_choice(self.protocol, "protocol", _PROTOCOLS, _PROTOCOLS)
        if isinstance(self.subscribe_qos, bool) or self.subscribe_qos not in (0, 1):
            raise ValueError(f"subscribe_qos must be 0 or 1, got {self.subscribe_qos!r}")
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

    def _split_all(self) -> list[tuple[str, str, int]]:
        """``(scheme, host, port)`` of each URL of the list, validated."""
        if not isinstance(self.url, str):
            return [_split_url(self.url)]  # says it is not a URL
        items = [u.strip() for u in self.url.split(",")]
        if len(items) > 1 and not all(items):
            raise ValueError(f"url {self.url!r} has an empty entry in its comma-separated list")
        parts = [_split_url(u) for u in items]
        schemes = {scheme for scheme, _, _ in parts}
        if len(schemes) > 1:
            raise ValueError(f"url {self.url!r} mixes mqtt:// and mqtts://: every broker of a list must use the "
                             "same scheme (one set of TLS options serves them all)")
        seen: set[tuple[str, int]] = set()
        for _, host, port in parts:
            if (host.lower(), port) in seen:
                raise ValueError(f"url {self.url!r} lists {host}:{port} twice")
            seen.add((host.lower(), port))
        return parts

    def _split(self) -> tuple[str, str, int]:
        return self._split_all()[0]

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
        parser.add_argument("--subscribe-qos", type=int, default=1, choices=[0, 1],
                            help="QoS of this program's subscriptions: 1 keeps what comes while it is away; 0 keeps "
                                 "nothing and on a NATS cluster needs no JetStream consumer (a fleet connects "
                                 "faster)" + tail)

    @classmethod
    def from_args(cls, args: Any, url: str, **kw: Any) -> BrokerConfig:
        """The config of the options :meth:`add_arguments` added (the password read from its file)."""
        password = None
        if args.password_file:
            with open(args.password_file, encoding="utf-8") as f:
                password = f.read().strip()
        return cls.from_url(url, username=args.username, password=password, ca_certs=args.ca_certs,
                            certfile=args.certfile, keyfile=args.keyfile, protocol=args.protocol,
                            max_payload=args.max_payload, subscribe_qos=getattr(args, "subscribe_qos", 1), **kw)

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> BrokerConfig:
        """Build a config from a broker URL and keyword overrides.

        ``mqtt://user:secret@host`` is accepted here: the credentials move to
        ``username``/``password`` (keywords win) and leave the URL (in a
        comma-separated list, every URL that holds credentials must hold the
        same).

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
        items = url.split(",") if isinstance(url, str) else [url]
        clean, found = [], set()
        for item in items:
            try:
                parts = urlsplit(item.strip() if isinstance(item, str) else item)
                user, secret = parts.username, parts.password
            except (TypeError, ValueError) as e:
                raise ValueError(f"url {url!r} is not a URL: {e}") from None
            if user is not None or secret is not None:
                netloc = parts.netloc.rpartition("@")[2]
                item = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
                found.add((user, secret))
            clean.append(item)
        if len(found) > 1:
            raise ValueError("the urls of the list hold different credentials: give one username and password")
        if found:
            user, secret = found.pop()
            url = ",".join(clean)
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

    @property
    def urls(self) -> tuple[str, ...]:
        """Each broker's URL, in the order the transport tries them (one for a single broker)."""
        return tuple(u.strip() for u in self.url.split(","))

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        """Each broker's ``(host, port)``, in the order of :attr:`urls`."""
        return tuple((host, port) for _, host, port in self._split_all())


def _split_url(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of one broker URL; ``ValueError`` naming what is wrong with it."""
    try:
        parts = urlsplit(url)
    except (TypeError, ValueError) as e:
        raise ValueError(f"url {url!r} is not a URL: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"url scheme must be 'mqtt' or 'mqtts', got {parts.scheme!r} in {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"url {url!r} holds credentials: pass username and password separately")
    if not parts.hostname:
        raise ValueError(f"url {url!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"url {url!r} must be scheme://host:port with nothing after the port")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"port in url {url!r} must be an integer in [1, 65535]") from None
    if port is None:
        port = _SCHEMES[scheme][0]
    if not 1 <= port <= 65535:
        raise ValueError(f"port in url {url!r} must be an integer in [1, 65535]")
    return scheme, parts.hostname, port
