"""The envelope: one binary frame per MQTT payload, its header, ids and JSON meta.

Every MQTT payload is one *envelope*, big-endian::

    offset  size  field
    0       2     magic b"FS"
    2       1     protocol version (1)
    3       1     kind (:class:`Kind`)
    4       1     flags (bit 0: signed, see below; other bits 0 in version 1)
    5       4     round (u32)
    9       2     meta_len (u16): length of the JSON meta, 0 when empty
    11      4     body_len (u32)
    15      1+n   federation (u8 length, utf-8)
    ..      1+n   sender (u8 length, utf-8)
    ..      meta_len   meta: a compact JSON object (commands, metrics, hello facts)
    ..      body_len   body: packed sketch bits, safetensors tensors, or a chunk
    ..      72    only when signed: u64 signed_at (ms) + Ed25519 signature
                  (:mod:`edge_sdk.signing`; the server signs, devices verify)

The decoder trusts nothing: the declared sizes must add up to the payload's
exact length, ids must be plain topic-safe words, the meta must be a JSON
object, and tensors and sketches are checked against the shapes the caller
expects. Every rejection raises :class:`ProtocolError` with a short
``reason`` code that transports count. Nothing here ever unpickles.

A 10-class x 20-bit sketch from client ``c07`` of federation ``demo`` is 53
bytes on the wire: 15 header + 5 federation + 4 sender + 29 body (4 bytes of
shape and 25 of bits). :meth:`Message.wire_size` gives that number without
encoding the message.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "FLAG_SIGNED",
    "HEADER_SIZE",
    "Kind",
    "MAGIC",
    "MAX_ID_BYTES",
    "MAX_META_BYTES",
    "MAX_META_DEPTH",
    "MAX_META_INT",
    "Message",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "SERVER_ID",
    "SIGNATURE_TRAILER",
    "check_id",
    "decode_message",
    "encode_message",
]

PROTOCOL_VERSION = 1
MAGIC = b"FS"
_HEADER = struct.Struct(">2sBBBIHI")
#: Bytes of the fixed header, before the federation and sender ids.
HEADER_SIZE = _HEADER.size
#: Longest federation, sender, client or cluster id, in utf-8 bytes.
MAX_ID_BYTES = 64
#: Largest JSON meta (the u16 length field's limit).
MAX_META_BYTES = 0xFFFF
#: The id the server speaks as (the sender of every command and model; its broker user name).
SERVER_ID = "server"
#: Bit of the flags byte: a 72-byte signature trailer follows the body (:mod:`edge_sdk.signing`).
FLAG_SIGNED = 0x01
#: Bytes of that trailer: u64 signed_at (ms) and a 64-byte Ed25519 signature.
SIGNATURE_TRAILER = 72
#: Deepest nesting of arrays and objects a meta may have.
MAX_META_DEPTH = 8
#: Largest integer magnitude a meta may hold (exact in a float64).
MAX_META_INT = 2**53
#: Default largest envelope :func:`decode_message` accepts (300 MB).
DEFAULT_MAX_MESSAGE = 300_000_000
_MAX_ROUND = 0xFFFFFFFF
_MAX_BODY = 0xFFFFFFFF
_FORBIDDEN_ID_CHARS = frozenset("/+#")


class Kind(enum.IntEnum):
    """What an envelope carries."""

    HELLO = 1
    SKETCH = 2
    UPDATE = 3
    STATUS = 4
    CMD = 5
    MODEL = 6
    METRICS = 7
    CHUNK = 8
    FEATURES = 9  #: a client summary other than bits (e.g. LADD's spectra), as tensors
    RECEIPT = 10  #: aggregator -> server: one device's update taken (its norm, its count) or refused
    PARTIAL = 11  #: aggregator -> server: the weighted mean of its devices' updates for one model
    COLLECT = 12  #: server -> aggregators: a round opens; the model its updates start from
    FLUSH = 13  #: server -> one aggregator: the round closed; what to sum of whose update
    REVEAL = 14  #: device -> server: secure aggregation's answer to an unmask command (edge_sdk.secure.Reveal)


class ProtocolError(ValueError):
    """A payload or body that breaks the protocol.

    Parameters
    ----------
    reason : str
        Short machine-readable code, for example ``"version"``,
        ``"truncated"``, ``"sender"`` or ``"non-finite"``; transports count
        rejections by it.
    message : str
        What was wrong, for people.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Message:
    """One envelope: who sent what, for which federation and round.

    Parameters
    ----------
    kind : Kind
        What the body holds.
    federation : str
        The federation's id (topic-safe word).
    sender : str
        The sending client's id, or the server's.
    round : int
        Training round in ``[0, 2**32)``; 0 outside rounds.
    meta : Mapping[str, Any]
        JSON-serialisable facts (commands, metrics, hello, chunk bookkeeping).
    body : bytes
        Binary body: packed sketch bits, safetensors bytes, a chunk slice.
    """

    kind: Kind
    federation: str
    sender: str
    round: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    body: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise ProtocolError("kind", f"unknown message kind {self.kind!r}") from None
        if not isinstance(self.body, bytes):
            object.__setattr__(self, "body", bytes(self.body))

    def wire_size(self, max_payload: int | None = None) -> int:
        """Bytes this message takes on the wire, computed without encoding its body.

        Parameters
        ----------
        max_payload : int, optional
            The largest payload one publish may carry. When the envelope is
            longer, the result is the sum of the CHUNK envelopes
            :func:`~edge_sdk.protocol.split_payload` cuts it into.

        Returns
        -------
        int
            ``len(encode_message(msg))``, or, past ``max_payload``,
            ``sum(map(len, split_payload(encode_message(msg), ...)))`` with
            this message's federation, sender and round. Unsigned: a signed
            payload, and each of its chunks, carries :data:`SIGNATURE_TRAILER`
            bytes more.

        Raises
        ------
        ProtocolError
            For an invalid message, as :func:`encode_message`.
        ValueError
            When ``max_payload`` leaves no room for data after a chunk header.
        """
        size = sum(map(len, _head_parts(self))) + len(self.body)
        if max_payload is None or size <= max_payload:
            return size
        from .chunk_split import (
            chunked_size,  # chunk_split builds on this module: imported when needed
        )

        return chunked_size(size, max_payload=max_payload, federation=self.federation, sender=self.sender,
                            round=self.round, inner_kind=int(self.kind))


# -- ids ------------------------------------------------------------------


def check_id(value: Any, what: str = "id", *, reason: str = "id") -> str:
    """Validate a federation, client or cluster id and return it.

    An id is 1 to :data:`MAX_ID_BYTES` utf-8 bytes of printable characters
    without whitespace, ``/``, ``+`` or ``#``: it is one MQTT topic level and
    an ACL ``%u`` user name.

    Raises
    ------
    ProtocolError
        With the given ``reason`` (a ``ValueError``).
    """
    if not isinstance(value, str):
        raise ProtocolError(reason, f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise ProtocolError(reason, f"{what} is empty")
    n = len(value.encode("utf-8", "surrogatepass"))
    if n > MAX_ID_BYTES:
        raise ProtocolError(reason, f"{what} is too long ({n} bytes, at most {MAX_ID_BYTES})")
    bad = sorted({c for c in value if c in _FORBIDDEN_ID_CHARS or not c.isprintable() or c.isspace()})
    if bad:
        raise ProtocolError(
            reason,
            f"{what} {value!r} contains forbidden characters {bad!r} "
            "(no '/', '+', '#', whitespace or non-printables)",
        )
    return value


# -- envelope -------------------------------------------------------------


def _dump_meta(meta: Mapping[str, Any]) -> bytes:
    if not isinstance(meta, Mapping):
        raise ProtocolError("meta", f"meta must be a mapping, got {type(meta).__name__}")
    if not meta:
        return b""
    try:
        raw = json.dumps(dict(meta), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ProtocolError("meta", f"meta is not JSON-serialisable: {e}") from e
    data = raw.encode("utf-8")
    if len(data) > MAX_META_BYTES:
        raise ProtocolError("meta", f"meta is {len(data)} bytes of JSON, at most {MAX_META_BYTES}")
    return data


def _head_parts(msg: Message) -> tuple[bytes, ...]:
    """Validate ``msg`` and return its encoded envelope up to the body, in pieces."""
    fed = check_id(msg.federation, "federation", reason="federation").encode("utf-8")
    snd = check_id(msg.sender, "sender", reason="sender").encode("utf-8")
    rnd = msg.round
    if isinstance(rnd, bool) or not isinstance(rnd, (int, np.integer)) or not 0 <= rnd <= _MAX_ROUND:
        raise ProtocolError("round", f"round must be an integer in [0, 2**32), got {rnd!r}")
    meta = _dump_meta(msg.meta)
    body = msg.body
    if len(body) > _MAX_BODY:
        raise ProtocolError("oversized", f"body of {len(body)} bytes exceeds the 4 GiB field")
    head = _HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg.kind), 0, int(rnd), len(meta), len(body))
    return head, bytes((len(fed),)), fed, bytes((len(snd),)), snd, meta


def encode_message(msg: Message) -> bytes:
    """Serialise a :class:`Message` into one envelope.

    Raises
    ------
    ProtocolError
        When the message itself is invalid (bad ids, round out of range, meta
        not a JSON object or too large, body over 4 GiB).
    """
    return b"".join((*_head_parts(msg), msg.body))


def _read_id(payload: bytes, pos: int, what: str) -> tuple[str, int]:
    if pos >= len(payload):
        raise ProtocolError("truncated", f"payload ends before the {what} id")
    n = payload[pos]
    end = pos + 1 + n
    if end > len(payload):
        raise ProtocolError("truncated", f"payload ends inside the {what} id ({n} bytes declared)")
    try:
        value = payload[pos + 1 : end].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(what, f"{what} id is not valid utf-8") from None
    return check_id(value, what, reason=what), end


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # JSON reads 1e400 as infinity
        raise ValueError(f"number {text[:32]} is not a finite float64")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20:  # longer than any integer in range: never build a huge int
        raise ValueError(f"integer {text[:32]}... is outside [-2**53, 2**53]")
    value = int(text)
    if abs(value) > MAX_META_INT:
        raise ValueError(f"integer {text} is outside [-2**53, 2**53]")
    return value


def _nesting(raw: str) -> int:
    """Deepest nesting of JSON arrays and objects in ``raw`` (brackets inside strings ignored)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in raw:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _load_meta(raw: bytes) -> dict[str, Any]:
    """Decode a JSON meta, refusing what no FedSketch peer sends.

    Besides JSON syntax: numbers must be finite (``1e400`` is refused, not read
    as infinity), integers within +-2**53 (``10**400`` is refused before it is
    built), NaN and Infinity literals are refused, and objects and arrays may
    nest at most :data:`MAX_META_DEPTH` deep (checked before parsing, so no
    recursion error and no traceback).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError("meta", f"meta is not valid JSON (not utf-8): {e}") from None
    depth = _nesting(text)
    if depth > MAX_META_DEPTH:
        raise ProtocolError("meta-depth", f"meta nests {depth} levels deep, at most {MAX_META_DEPTH}")
    try:
        meta = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                          parse_int=_bounded_int)
    except (ValueError, RecursionError) as e:
        raise ProtocolError("meta", f"meta is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ProtocolError("meta", f"meta must be a JSON object, got {type(meta).__name__}")
    return meta


def _read_header(payload: bytes) -> tuple[Kind, int, int, int, int]:
    """Check the fixed header; return its kind, flags, round, meta_len and body_len."""
    if len(payload) < HEADER_SIZE:
        raise ProtocolError(
            "truncated", f"payload of {len(payload)} bytes is shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, kind, flags, rnd, meta_len, body_len = _HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise ProtocolError("magic", f"not a FedSketch envelope (magic {magic!r}, expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version", f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError("kind", f"unknown message kind {kind}") from None
    if flags & ~FLAG_SIGNED:
        raise ProtocolError("flags", f"unknown flags 0x{flags:02x} for protocol version {version}")
    return kind, flags, rnd, meta_len, body_len


def decode_message(
    payload: bytes,
    *,
    max_size: int = DEFAULT_MAX_MESSAGE,
    expected_sender: str | None = None,
    expected_federation: str | None = None,
) -> Message:
    """Parse and validate one envelope.

    Parameters
    ----------
    payload : bytes
        The whole MQTT payload.
    max_size : int
        Largest payload accepted, in bytes.
    expected_sender : str, optional
        The id the sender must have (the ``<id>`` of a ``clients/<id>/...``
        topic): a client cannot speak for another.
    expected_federation : str, optional
        The federation the envelope must belong to.

    Returns
    -------
    Message

    Raises
    ------
    ProtocolError
        Reasons: ``oversized``, ``truncated``, ``trailing``, ``magic``,
        ``version``, ``kind``, ``flags``, ``federation``, ``sender``, ``meta``.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError("type", f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) > max_size:
        raise ProtocolError("oversized", f"payload of {len(payload)} bytes exceeds the limit of {max_size}")
    kind, flags, rnd, meta_len, body_len = _read_header(payload)
    trailer = SIGNATURE_TRAILER if flags & FLAG_SIGNED else 0
    federation, pos = _read_id(payload, HEADER_SIZE, "federation")
    sender, pos = _read_id(payload, pos, "sender")
    need = pos + meta_len + body_len + trailer
    if len(payload) < need:
        raise ProtocolError(
            "truncated",
            f"payload of {len(payload)} bytes is shorter than its declared sizes "
            f"(meta {meta_len} + body {body_len} need {need})",
        )
    if len(payload) > need:
        raise ProtocolError(
            "trailing",
            f"payload of {len(payload)} bytes is longer than its declared sizes "
            f"(meta {meta_len} + body {body_len} need {need})",
        )
    if expected_federation is not None and federation != expected_federation:
        raise ProtocolError(
            "federation", f"federation {federation!r} does not match the expected {expected_federation!r}"
        )
    if expected_sender is not None and sender != expected_sender:
        raise ProtocolError(
            "sender", f"sender {sender!r} does not match the topic's client id {expected_sender!r}"
        )
    meta = _load_meta(payload[pos : pos + meta_len]) if meta_len else {}
    body = payload[pos + meta_len : need - trailer]
    return Message(kind, federation, sender, rnd, meta, body)
