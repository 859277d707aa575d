"""Devices obey only their server: Ed25519 signatures on what the server sends.

The server holds a private key; each device is given the matching public key
at enrolment (``deploy/make_passwords.sh`` writes both beside the broker
passwords, ``fedsketch keygen`` makes a pair). The server's transport signs
every envelope it publishes (commands, models, encoders, and each chunk of a
large one); a device's transport, given the public key, refuses every
incoming envelope that is unsigned, badly signed, older than it allows or a
replay, before any handler sees it.

A signed envelope has bit 0 of its flags byte set and ends with a 72-byte
trailer::

    u64  signed_at  milliseconds since the Unix epoch (server clock)
    64   signature  Ed25519 over  DOMAIN || sha256(envelope with its flag bit || signed_at)

Signing the SHA-256 digest keeps the cost of a 45 MB model at one hash (the
signature itself costs the same for 50 bytes or 50 MB).

Freshness: a device refuses a signed envelope older than ``max_age_s`` by
its own clock (default one hour: keep device clocks on NTP), older than the
newest it has seen by more than ``window_s`` (default 5 minutes), and any
exact replay of one it has seen in that window. A captured ``stop`` cannot be
replayed to a device later.

The server's last will is the one exception, by design: it is signed when
the server connects, and the broker publishes it only when the server's
connection dies, hours later perhaps, so no freshness rule of age could
accept it. Instead each of the server's run announcements (signed and
fresh) names its will by :func:`signature_id`; a device admits that one
signature (:meth:`Verifier.admit`) and accepts the will whatever its age,
once. A captured will is good for nothing but telling the devices of that
very server process that it is away.

What this does not do: encrypt (use TLS), authenticate devices to the server
(that is the broker's password and ACL: a device's message is trusted as far
as the broker vouches for the user name on its topic), or stop a flood
(the broker's limits and the ACL do).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from .protocol import FLAG_SIGNED, HEADER_SIZE, MAGIC, SIGNATURE_TRAILER, ProtocolError

__all__ = [
    "FLAG_SIGNED",
    "SIGNATURE_TRAILER",
    "Signer",
    "Verifier",
    "generate_key",
    "load_signer",
    "load_verifier",
    "sign_payload",
    "signature_id",
    "verify_payload",
    "write_keypair",
]

_TRAILER = struct.Struct(">Q64s")
assert _TRAILER.size == SIGNATURE_TRAILER
_DOMAIN = b"FedSketch envelope signature v1\x00"
_FLAGS_OFFSET = 4


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:  # pragma: no cover - a base dependency
        raise ImportError("signing needs the 'cryptography' package: pip install cryptography") from e
    return serialization, ed25519


def _digest(signed_part: bytes) -> bytes:
    return _DOMAIN + hashlib.sha256(signed_part).digest()


def generate_key():
    """A new Ed25519 private key (``cryptography``'s ``Ed25519PrivateKey``)."""
    return _crypto()[1].Ed25519PrivateKey.generate()


def write_keypair(private_path: str | Path, public_path: str | Path) -> None:
    """Write a new key pair as PEM: the private key (mode 600) and its public half.

    Both are the standard formats ``openssl genpkey -algorithm ed25519`` and
    ``openssl pkey -pubout`` write.
    """
    serialization, _ = _crypto()
    key = generate_key()
    private = Path(private_path)
    private.touch(mode=0o600, exist_ok=False)
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    Path(public_path).write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def _load_pem(path: str | Path, public: bool):
    serialization, ed25519 = _crypto()
    data = Path(path).read_bytes()
    try:
        key = (serialization.load_pem_public_key(data) if public
               else serialization.load_pem_private_key(data, password=None))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a PEM {'public' if public else 'private'} key: {e}") from None
    want = ed25519.Ed25519PublicKey if public else ed25519.Ed25519PrivateKey
    if not isinstance(key, want):
        raise ValueError(f"{path}: not an Ed25519 key ({type(key).__name__})")
    return key


def sign_payload(payload: bytes, key, *, now_ms: int | None = None) -> bytes:
    """``payload`` (an unsigned envelope) with its signed flag set and the signature trailer."""
    if len(payload) < HEADER_SIZE or payload[:2] != MAGIC:
        raise ValueError("only a FedSketch envelope can be signed")
    if payload[_FLAGS_OFFSET] & FLAG_SIGNED:
        raise ValueError("envelope is already signed")
    buf = bytearray(payload)
    buf[_FLAGS_OFFSET] |= FLAG_SIGNED
    ts = int(time.time() * 1000) if now_ms is None else int(now_ms)
    signed_part = bytes(buf) + struct.pack(">Q", ts)
    return signed_part + key.sign(_digest(signed_part))


def verify_payload(payload: bytes, public_key) -> int:
    """Check a signed envelope's signature; returns its ``signed_at`` (ms).

    Raises
    ------
    ProtocolError
        Reason ``unsigned`` (no signature) or ``signature`` (bad or truncated).
    """
    from cryptography.exceptions import InvalidSignature

    if len(payload) < HEADER_SIZE + SIGNATURE_TRAILER or not payload[_FLAGS_OFFSET] & FLAG_SIGNED:
        raise ProtocolError("unsigned", "message is not signed by the server (this device has its key)")
    ts, sig = _TRAILER.unpack_from(payload, len(payload) - SIGNATURE_TRAILER)
    try:
        public_key.verify(sig, _digest(payload[:-64]))
    except InvalidSignature:
        raise ProtocolError("signature", "message signature does not verify with the server's key") from None
    return ts


def signature_id(payload: bytes) -> str | None:
    """A signed envelope's name: the first 16 bytes of its signature, in hex (None: not signed).

    The only envelope whose signature verifies with that prefix is that one:
    a device may admit it by this name (:meth:`Verifier.admit`).
    """
    if len(payload) < HEADER_SIZE + SIGNATURE_TRAILER or not payload[_FLAGS_OFFSET] & FLAG_SIGNED:
        return None
    return payload[-64:-48].hex()


class Signer:
    """Signs envelopes with the server's private key (see the module docstring)."""

    def __init__(self, key, *, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.clock = clock

    def __repr__(self) -> str:
        return "Signer(ed25519)"

    def sign(self, payload: bytes) -> bytes:
        return sign_payload(payload, self.key, now_ms=int(self.clock() * 1000))


class Verifier:
    """A device's check of what claims to come from its server: signature, age, replay.

    Parameters
    ----------
    public_key : Ed25519PublicKey
        The server's public key, given at enrolment.
    max_age_s : float
        Oldest signed message accepted, by this device's clock.
    window_s : float
        How far behind the newest message seen one may be; exact replays
        within it are refused too.
    clock : callable
        Wall-clock seconds (``time.time``), replaceable in tests.
    """

    def __init__(self, public_key, *, max_age_s: float = 3600.0, window_s: float = 300.0,
                 clock: Callable[[], float] = time.time, max_remembered: int = 65536) -> None:
        if not (max_age_s > 0 and window_s > 0):
            raise ValueError(f"max_age_s and window_s must be positive, got {max_age_s!r} and {window_s!r}")
        self.public_key = public_key
        self.max_age_ms = int(max_age_s * 1000)
        self.window_ms = int(window_s * 1000)
        self.clock = clock
        self.max_remembered = int(max_remembered)
        self._newest = 0
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._admitted: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Verifier(max_age_s={self.max_age_ms / 1000:g}, window_s={self.window_ms / 1000:g})"

    #: Signatures admitted at once, at most (a run's will each; the oldest is forgotten first).
    MAX_ADMITTED = 8

    def admit(self, name: str) -> None:
        """Accept, once and whatever its age, the signed envelope named ``name`` (:func:`signature_id`).

        What a run's announcement says of the server's last will (see the module docstring).
        """
        with self._lock:
            self._admitted[str(name)] = None
            while len(self._admitted) > self.MAX_ADMITTED:
                self._admitted.popitem(last=False)

    def check(self, payload: bytes) -> None:
        """Accept ``payload`` or raise :class:`~edge_sdk.protocol.ProtocolError`.

        Reasons: ``unsigned``, ``signature``, ``stale`` (too old), ``replay``.
        """
        ts = verify_payload(payload, self.public_key)
        sig = payload[-64:]
        now = int(self.clock() * 1000)
        with self._lock:
            if self._admitted and sig[:16].hex() in self._admitted:  # an admitted will: any age, once
                del self._admitted[sig[:16].hex()]
                self._seen[sig] = ts
                return
            if ts < now - self.max_age_ms:
                raise ProtocolError("stale", f"signed message is {(now - ts) / 1000:.0f} s old by this device's "
                                             f"clock (at most {self.max_age_ms / 1000:g}); are both clocks on NTP?")
            if ts < self._newest - self.window_ms:
                raise ProtocolError("stale", f"signed message is {(self._newest - ts) / 1000:.0f} s older than "
                                             "the newest from the server")
            if sig in self._seen:
                raise ProtocolError("replay", "signed message seen before (a replay or a duplicate)")
            self._seen[sig] = ts
            self._newest = max(self._newest, ts)
            floor = self._newest - self.window_ms
            while self._seen and (len(self._seen) > self.max_remembered or next(iter(self._seen.values())) < floor):
                self._seen.popitem(last=False)


def load_signer(path: str | Path) -> Signer:
    """The server's :class:`Signer` from its PEM private key file."""
    return Signer(_load_pem(path, public=False))


def load_verifier(path: str | Path, **kw) -> Verifier:
    """A device's :class:`Verifier` from the server's PEM public key file."""
    return Verifier(_load_pem(path, public=True), **kw)
