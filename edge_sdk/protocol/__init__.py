"""The one wire format of FedSketch: topics, a binary envelope, bodies and chunks.

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
shape and 25 of bits).

Payloads above a broker's message limit are cut by :func:`split_payload` into
``CHUNK`` envelopes and put back together by a :class:`Reassembler`, which
checks the whole payload's sha256 and forgets partial transfers that stall.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..sketch import Sketch

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "FLAG_SIGNED",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_ID_BYTES",
    "MAX_META_BYTES",
    "SERVER_ID",
    "MAX_META_DEPTH",
    "MAX_META_INT",
    "PROTOCOL_VERSION",
    "SIGNATURE_TRAILER",
    "Kind",
    "Message",
    "ProtocolError",
    "Reassembler",
    "Topics",
    "check_id",
    "decode_message",
    "encode_message",
    "parse_sketch",
    "parse_tensors",
    "sketch_body",
    "split_payload",
    "tensors_body",
]

log = logging.getLogger(__name__)

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
_SKETCH_SHAPE = struct.Struct(">HH")
_CHUNK_KEYS = frozenset({"id", "i", "n", "size", "sha256", "k"})
_MAX_TRANSFER_ID = 64
_MAX_DONE = 1024
#: Reassembler defaults: a transfer idle this long is dropped (seconds).
DEFAULT_CHUNK_TIMEOUT = 60.0
#: ... and one not complete this long after its first chunk (seconds; a 45 MB
#: model needs about 10 minutes at 0.6 Mbit/s).
DEFAULT_CHUNK_DEADLINE = 600.0
#: ... most transfers in progress per (federation, sender).
DEFAULT_CHUNK_PENDING_PER_SENDER = 2
#: ... most bytes all pending transfers may declare together.
DEFAULT_CHUNK_MEMORY = 512 * 1024 * 1024


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


_INNER_KINDS = frozenset(int(k) for k in Kind if k != Kind.CHUNK)


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


def encode_message(msg: Message) -> bytes:
    """Serialise a :class:`Message` into one envelope.

    Raises
    ------
    ProtocolError
        When the message itself is invalid (bad ids, round out of range, meta
        not a JSON object or too large, body over 4 GiB).
    """
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
    return b"".join((head, bytes((len(fed),)), fed, bytes((len(snd),)), snd, meta, body))


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


# -- sketch bodies ----------------------------------------------------------


def sketch_body(sketch: Sketch) -> bytes:
    """Body of a SKETCH message: u16 num_classes, u16 latent_dim, packed bits."""
    if not (0 < sketch.num_classes <= 0xFFFF and 0 < sketch.latent_dim <= 0xFFFF):
        raise ValueError(
            f"sketch shape ({sketch.num_classes}, {sketch.latent_dim}) does not fit in two u16 fields"
        )
    return _SKETCH_SHAPE.pack(sketch.num_classes, sketch.latent_dim) + sketch.bits


def parse_sketch(body: bytes, *, num_classes: int | None = None, latent_dim: int | None = None) -> Sketch:
    """Read a SKETCH body back into a :class:`~edge_sdk.sketch.Sketch`.

    Parameters
    ----------
    body : bytes
        The message body.
    num_classes, latent_dim : int, optional
        The shape the server expects; a sketch of another shape is refused.

    Raises
    ------
    ProtocolError
        Reason ``sketch-length``: short body, wrong shape, wrong number of
        bytes, or padding bits set.
    """
    if len(body) < _SKETCH_SHAPE.size:
        raise ProtocolError("sketch-length", f"sketch body of {len(body)} bytes lacks its 4-byte shape")
    nc, ld = _SKETCH_SHAPE.unpack_from(body)
    if (num_classes is not None and nc != num_classes) or (latent_dim is not None and ld != latent_dim):
        raise ProtocolError(
            "sketch-length",
            f"sketch shape ({nc} classes, {ld} bits) differs from the expected "
            f"({num_classes} classes, {latent_dim} bits)",
        )
    try:
        return Sketch(bytes(body[_SKETCH_SHAPE.size :]), nc, ld)
    except ValueError as e:
        raise ProtocolError("sketch-length", f"invalid sketch body: {e}") from None


# -- tensor bodies ----------------------------------------------------------


def tensors_body(tensors: Mapping[str, np.ndarray]) -> bytes:
    """Serialise named arrays with safetensors (never pickle)."""
    from safetensors.numpy import save

    if not tensors:
        raise ValueError("no tensors to serialise")
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        arr = np.asarray(value)
        # (np.ascontiguousarray would turn a 0-d array into shape (1,))
        arrays[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")
    return save(arrays)


def _check_spec(spec: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    out = {}
    for name, entry in spec.items():
        try:
            shape, dtype = entry
            out[name] = (tuple(int(d) for d in shape), np.dtype(dtype))
        except (TypeError, ValueError) as e:
            raise ValueError(f"spec entry {name!r} must be (shape, dtype name), got {entry!r}: {e}") from None
    return out


def parse_tensors(
    body: bytes, *, spec: Mapping[str, tuple[tuple[int, ...], str]] | None = None
) -> dict[str, np.ndarray]:
    """Read a safetensors body, checking it against what the receiver expects.

    Parameters
    ----------
    body : bytes
        The message body.
    spec : mapping of name to (shape, dtype), optional
        The exact tensor names, shapes and dtypes (``"float32"``...) the
        receiver expects. Without it only the format and finiteness are checked.

    Returns
    -------
    dict of str to ndarray
        Writable arrays, in the order of the payload.

    Raises
    ------
    ProtocolError
        Reasons: ``tensors`` (not safetensors), ``tensor-name``,
        ``tensor-shape``, ``tensor-dtype``, ``non-finite``.
    """
    from safetensors.numpy import load

    expected = None if spec is None else _check_spec(spec)
    try:
        arrays = load(bytes(body))
    except Exception as e:  # safetensors raises its own error types (and TypeError on odd dtypes)
        raise ProtocolError("tensors", f"body is not valid safetensors data: {e}") from None
    if expected is not None and set(arrays) != set(expected):
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        raise ProtocolError("tensor-name", f"tensor names differ from the spec: missing {missing}, unexpected {extra}")
    out = {}
    for name, arr in arrays.items():
        if expected is not None:
            shape, dtype = expected[name]
            if arr.shape != shape:
                raise ProtocolError("tensor-shape", f"tensor {name!r} has shape {arr.shape}, expected {shape}")
            if arr.dtype != dtype:
                raise ProtocolError("tensor-dtype", f"tensor {name!r} has dtype {arr.dtype}, expected {dtype}")
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            raise ProtocolError("non-finite", f"tensor {name!r} contains NaN or Inf")
        out[name] = arr.copy()
    return out


# -- chunking ---------------------------------------------------------------


def split_payload(
    payload: bytes, *, max_payload: int, federation: str, sender: str, round: int = 0
) -> list[bytes]:
    """Cut a payload into CHUNK envelopes of at most ``max_payload`` bytes each.

    Parameters
    ----------
    payload : bytes
        Usually an encoded envelope that is too large for the broker.
    max_payload : int
        Largest encoded chunk, in bytes.
    federation, sender : str
        Ids written into every chunk (the receiver checks the sender against
        the topic, as for any message).
    round : int
        Round written into every chunk.

    Returns
    -------
    list of bytes
        ``[payload]`` unchanged when it fits; otherwise encoded CHUNK messages
        whose meta holds the transfer ``id``, index ``i``, count ``n``, total
        ``size``, the whole payload's ``sha256`` and, for an envelope, the
        inner message kind ``k`` (so byte counts can be attributed).
    """
    payload = bytes(payload)
    if len(payload) <= max_payload:
        return [payload]
    total = len(payload)
    digest = hashlib.sha256(payload).hexdigest()
    transfer = secrets.token_hex(8)
    inner_kind = payload[3] if payload[:2] == MAGIC and len(payload) >= HEADER_SIZE else None

    def meta(i: int, n: int) -> dict[str, Any]:
        m: dict[str, Any] = {"id": transfer, "i": i, "n": n, "size": total, "sha256": digest}
        if inner_kind is not None:
            m["k"] = inner_kind
        return m

    # Upper bound of the envelope overhead: index and count as wide as the payload's length.
    worst = len(encode_message(Message(Kind.CHUNK, federation, sender, round, meta(total, total))))
    step = max_payload - worst
    if step < 1:
        raise ValueError(f"max_payload={max_payload} leaves no room for data after the {worst}-byte chunk header")
    n = math.ceil(total / step)
    chunks = []
    for i in range(n):
        piece = payload[i * step : (i + 1) * step]
        chunk = encode_message(Message(Kind.CHUNK, federation, sender, round, meta(i, n), piece))
        chunks.append(chunk)
    log.debug("split %d bytes into %d chunks of at most %d bytes (transfer %s)", total, n, max_payload, transfer)
    return chunks


def _int_field(meta: Mapping[str, Any], key: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError("chunk", f"chunk meta field {key!r} must be an integer, got {v!r}")
    return v


@dataclass
class _Partial:
    n: int
    size: int
    sha256: str
    kind: int | None
    started: float
    touched: float
    parts: dict[int, bytes] = field(default_factory=dict)
    received: int = 0


class Reassembler:
    """Puts chunked payloads back together.

    Partial transfers are keyed by (federation, sender, transfer id), so one
    sender cannot complete or spoil another's. Each sender also has its own
    budget (``max_pending_per_sender`` transfers, ``max_sender_bytes``
    declared bytes), checked after the global ones: a sender over its budget
    is refused without taking a slot or a byte from anyone else. A transfer
    is dropped when it stalls (``timeout_s`` since its last chunk) and at its
    deadline (``deadline_s`` since its first chunk), even while chunks keep
    dripping in. Expiry runs at every :meth:`feed`; call :meth:`expire`
    from a timer to free stalled transfers when no chunk comes. Not
    thread-safe: feed and expire it from one thread, or under one lock.

    Parameters
    ----------
    max_total_bytes : int
        Most bytes all pending transfers may declare together; a transfer that
        would exceed it is refused (reason ``oversized``).
    timeout_s : float
        A transfer that receives no chunk for this long is dropped (logged).
    max_pending : int
        Most transfers in progress at once (reason ``pending`` above it).
    max_size : int, optional
        Largest single transfer (reason ``oversized`` above it).
    clock : callable
        Monotonic time source, replaceable in tests.
    deadline_s : float
        A transfer not complete this long after its first chunk is dropped.
    max_pending_per_sender : int
        Most transfers in progress per (federation, sender) (reason ``pending``).
    max_sender_bytes : int, optional
        Most bytes the pending transfers of one (federation, sender) may
        declare together (reason ``oversized``). Default: ``max_size``, else
        ``max_total_bytes``.
    """

    def __init__(
        self,
        max_total_bytes: int = DEFAULT_CHUNK_MEMORY,
        timeout_s: float = DEFAULT_CHUNK_TIMEOUT,
        max_pending: int = 64,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_size: int | None = None,
        deadline_s: float = DEFAULT_CHUNK_DEADLINE,
        max_pending_per_sender: int = DEFAULT_CHUNK_PENDING_PER_SENDER,
        max_sender_bytes: int | None = None,
    ) -> None:
        if max_total_bytes < 1 or max_pending < 1 or not timeout_s > 0:
            raise ValueError(
                "max_total_bytes and max_pending must be positive and timeout_s > 0, got "
                f"{max_total_bytes}, {max_pending}, {timeout_s}"
            )
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        if max_pending_per_sender < 1:
            raise ValueError(f"max_pending_per_sender must be positive, got {max_pending_per_sender!r}")
        if max_sender_bytes is not None and max_sender_bytes < 1:
            raise ValueError(f"max_sender_bytes must be positive, got {max_sender_bytes!r}")
        self.max_total_bytes = int(max_total_bytes)
        self.timeout_s = float(timeout_s)
        self.max_pending = int(max_pending)
        self.max_size = None if max_size is None else int(max_size)
        self.clock = clock
        self.deadline_s = float(deadline_s)
        self.max_pending_per_sender = int(max_pending_per_sender)
        if max_sender_bytes is None:
            max_sender_bytes = self.max_size if self.max_size is not None else self.max_total_bytes
        self.max_sender_bytes = int(max_sender_bytes)
        self._partials: dict[tuple[str, str, str], _Partial] = {}
        # Recently completed transfers: late duplicates (QoS 1 redeliveries) are ignored.
        self._done: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        #: Transfers dropped because they stalled (``timeout_s``), since creation.
        self.expired = 0
        #: Transfers dropped at their deadline (``deadline_s``), since creation.
        self.expired_deadline = 0
        #: Chunks refused by :meth:`feed` (every ProtocolError it raised), per reason.
        self.refused: dict[str, int] = {}

    def pending(self) -> int:
        """Number of transfers in progress."""
        return len(self._partials)

    def pending_bytes(self) -> int:
        """Bytes declared by the transfers in progress."""
        return sum(p.size for p in self._partials.values())

    def held_bytes(self) -> int:
        """Bytes of chunks actually held by the transfers in progress."""
        return sum(p.received for p in self._partials.values())

    def stats(self) -> dict[str, Any]:
        """Counters: ``pending``, ``pending_bytes``, ``held_bytes``, ``expired``
        (idle), ``expired_deadline`` and ``refused`` (per reason)."""
        return {
            "pending": self.pending(),
            "pending_bytes": self.pending_bytes(),
            "held_bytes": self.held_bytes(),
            "expired": self.expired,
            "expired_deadline": self.expired_deadline,
            "refused": dict(self.refused),
        }

    def _sender_load(self, federation: str, sender: str) -> tuple[int, int]:
        """Transfers in progress and bytes they declare, for one (federation, sender)."""
        count = nbytes = 0
        for (fed, snd, _), p in self._partials.items():
            if fed == federation and snd == sender:
                count += 1
                nbytes += p.size
        return count, nbytes

    def expire(self) -> int:
        """Drop transfers idle for longer than ``timeout_s`` or older than
        ``deadline_s`` (counted from their first chunk); returns how many.

        Each dropped transfer is logged once, with its sender, the chunks
        received and its age.
        """
        now = self.clock()
        dropped = 0
        for key, p in list(self._partials.items()):
            if now - p.started > self.deadline_s:
                why = f"not complete {self.deadline_s:g} s after its first chunk"
                self.expired_deadline += 1
            elif now - p.touched > self.timeout_s:
                why = f"{now - p.touched:.1f} s without progress"
                self.expired += 1
            else:
                continue
            del self._partials[key]
            dropped += 1
            log.warning(
                "dropped incomplete transfer %s from %s/%s: %d of %d chunks (%d of %d bytes), "
                "age %.1f s, %s",
                key[2], key[0], key[1], len(p.parts), p.n, p.received, p.size, now - p.started, why,
            )
        while self._done and (now - next(iter(self._done.values())) > self.timeout_s
                              or len(self._done) > _MAX_DONE):
            self._done.popitem(last=False)
        return dropped

    def _validate(self, msg: Message) -> tuple[str, int, int, int, str, int | None]:
        if msg.kind != Kind.CHUNK:
            raise ProtocolError("kind", f"expected a CHUNK message, got {msg.kind.name}")
        m = msg.meta
        unknown = sorted(set(m) - _CHUNK_KEYS)
        if unknown:
            raise ProtocolError("chunk", f"chunk meta has unknown fields {unknown}")
        tid = m.get("id")
        if not isinstance(tid, str) or not 0 < len(tid) <= _MAX_TRANSFER_ID or not (tid.isascii() and tid.isalnum()):
            raise ProtocolError("chunk", f"chunk transfer id must be 1-{_MAX_TRANSFER_ID} alphanumerics, got {tid!r}")
        i, n, size = _int_field(m, "i"), _int_field(m, "n"), _int_field(m, "size")
        if not (n >= 1 and 0 <= i < n):
            raise ProtocolError("chunk", f"chunk index {i} of {n} is out of range")
        if size < 0 or n > max(size, 1):
            raise ProtocolError("chunk", f"chunk count {n} is impossible for a total of {size} bytes")
        if self.max_size is not None and size > self.max_size:
            raise ProtocolError("oversized", f"chunked payload of {size} bytes exceeds the limit of {self.max_size}")
        digest = m.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ProtocolError("chunk", f"chunk sha256 must be 64 lowercase hex digits, got {digest!r}")
        k = m.get("k")
        if k is not None and (isinstance(k, bool) or k not in _INNER_KINDS):
            raise ProtocolError("chunk", f"chunk inner kind {k!r} is not a message kind other than CHUNK")
        return tid, i, n, size, digest, k

    def feed(self, msg: Message) -> bytes | None:
        """Take one CHUNK message.

        Returns
        -------
        bytes or None
            The original payload once every chunk has arrived and its sha256
            matches; ``None`` while chunks are missing (and for an exact
            duplicate).

        Raises
        ------
        ProtocolError
            Reasons: ``kind``, ``chunk`` (malformed or inconsistent chunks;
            the transfer is dropped), ``oversized`` (too large for the limit
            on one transfer, on all pending transfers or on one sender's),
            ``pending`` (too many transfers in progress, in all or from this
            sender), ``checksum``. Each is counted in :attr:`refused`.
        """
        try:
            return self._feed(msg)
        except ProtocolError as e:
            self.refused[e.reason] = self.refused.get(e.reason, 0) + 1
            raise

    def _feed(self, msg: Message) -> bytes | None:
        self.expire()
        tid, i, n, size, digest, k = self._validate(msg)
        key = (msg.federation, msg.sender, tid)
        now = self.clock()
        if key in self._done:
            log.debug("late duplicate chunk %d of completed transfer %s ignored", i, tid)
            return None
        part = self._partials.get(key)
        if part is None:
            if len(self._partials) >= self.max_pending:
                raise ProtocolError(
                    "pending", f"too many transfers in progress ({self.max_pending}); refusing transfer {tid}"
                )
            if self.pending_bytes() + size > self.max_total_bytes:
                raise ProtocolError(
                    "oversized",
                    f"transfer {tid} of {size} bytes would exceed the {self.max_total_bytes} bytes "
                    "allowed for pending transfers",
                )
            count, nbytes = self._sender_load(msg.federation, msg.sender)
            if count >= self.max_pending_per_sender:
                raise ProtocolError(
                    "pending",
                    f"sender {msg.sender!r} already has {count} transfers in progress (limit "
                    f"{self.max_pending_per_sender} per sender); refusing transfer {tid}",
                )
            if nbytes + size > self.max_sender_bytes:
                raise ProtocolError(
                    "oversized",
                    f"transfer {tid} of {size} bytes from sender {msg.sender!r} would exceed the "
                    f"{self.max_sender_bytes} bytes allowed per sender ({nbytes} pending)",
                )
            part = _Partial(n=n, size=size, sha256=digest, kind=k, started=now, touched=now)
            self._partials[key] = part
        elif (n, size, digest, k) != (part.n, part.size, part.sha256, part.kind):
            del self._partials[key]
            raise ProtocolError("chunk", f"chunk {i} of transfer {tid} disagrees with the earlier chunks; dropped")
        if i in part.parts:
            if part.parts[i] == msg.body:
                log.debug("duplicate chunk %d of transfer %s ignored", i, tid)
                return None
            del self._partials[key]
            raise ProtocolError("chunk", f"chunk {i} of transfer {tid} arrived twice with different bytes; dropped")
        if part.received + len(msg.body) > part.size:
            del self._partials[key]
            raise ProtocolError("chunk", f"transfer {tid} received more than its declared {part.size} bytes; dropped")
        part.parts[i] = msg.body
        part.received += len(msg.body)
        part.touched = now
        if len(part.parts) < part.n:
            return None
        del self._partials[key]
        self._done[key] = now
        payload = b"".join(part.parts[j] for j in range(part.n))
        if len(payload) != part.size:
            raise ProtocolError("chunk", f"transfer {tid} has {len(payload)} bytes, {part.size} declared")
        if hashlib.sha256(payload).hexdigest() != part.sha256:
            raise ProtocolError("checksum", f"transfer {tid} of {part.size} bytes fails its sha256 check")
        log.debug("reassembled transfer %s: %d chunks, %d bytes", tid, part.n, part.size)
        return payload


# -- topics -----------------------------------------------------------------


def _check_root(root: str) -> str:
    if not isinstance(root, str) or not root:
        raise ValueError(f"topic root must be a non-empty string, got {root!r}")
    for level in root.split("/"):
        try:
            check_id(level, "topic root level")
        except ProtocolError as e:
            raise ValueError(f"invalid topic root {root!r}: {e}") from None
    return root


class Topics:
    """Every topic of one federation, under ``<root>/<federation>/``.

    ========================================  ===========================
    ``clients/<id>/hello|sketch|update|``     client -> server
    ``status|metrics``
    ``clients/<id>/cmd``                      server -> one client
    ``clusters/<k>/model``                    server -> a cluster
    ``broadcast/cmd``                         server -> all clients
    ``server/status``                         server's own status
    ========================================  ===========================

    Id arguments are validated with :func:`check_id`; ``"+"`` is accepted in
    their place to build a subscription filter (for example ``model("+")``).

    Parameters
    ----------
    root : str
        First topic level(s), default ``"fedsketch"``.
    federation : str
        The federation's id.
    """

    def __init__(self, root: str = "fedsketch", federation: str = "default") -> None:
        self.root = _check_root(root)
        try:
            self.federation = check_id(federation, "federation")
        except ProtocolError as e:
            raise ValueError(str(e)) from None
        self.base = f"{self.root}/{self.federation}"

    def __repr__(self) -> str:
        return f"Topics(root={self.root!r}, federation={self.federation!r})"

    @staticmethod
    def _id(value: Any, what: str) -> str:
        value = str(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
        if value == "+":
            return value
        try:
            return check_id(value, what)
        except ProtocolError as e:
            raise ValueError(str(e)) from None

    def _client(self, cid: str, leaf: str) -> str:
        return f"{self.base}/clients/{self._id(cid, 'client id')}/{leaf}"

    def hello(self, cid: str) -> str:
        """Client -> server: registration facts."""
        return self._client(cid, "hello")

    def sketch(self, cid: str) -> str:
        """Client -> server: the sketch."""
        return self._client(cid, "sketch")

    def update(self, cid: str) -> str:
        """Client -> server: trained weights."""
        return self._client(cid, "update")

    def status(self, cid: str) -> str:
        """Client -> server: online/offline (the last will goes here)."""
        return self._client(cid, "status")

    def metrics(self, cid: str) -> str:
        """Client -> server: evaluation results."""
        return self._client(cid, "metrics")

    def cmd(self, cid: str) -> str:
        """Server -> one client: commands."""
        return self._client(cid, "cmd")

    def broadcast(self) -> str:
        """Server -> every client: commands for all (for example "send your sketch")."""
        return f"{self.base}/broadcast/cmd"

    def model(self, cluster: str | int) -> str:
        """Server -> the clients of one cluster: its model."""
        return f"{self.base}/clusters/{self._id(cluster, 'cluster id')}/model"

    def server_status(self) -> str:
        """The server's own status (retained)."""
        return f"{self.base}/server/status"

    def all_clients(self, leaf: str) -> str:
        """Filter over every client's ``leaf`` (``"#"`` for all of them)."""
        if leaf != "#":
            leaf = self._id(leaf, "leaf")
        return f"{self.base}/clients/+/{leaf}"

    def required_sender(self, topic: str) -> str | None:
        """The id a message on ``topic`` must come from, or None when the topic does not say.

        Under ``clients/<id>/`` every leaf is written by client ``<id>``,
        except ``cmd``, which the server writes.
        """
        parsed = self.parse(topic)
        if parsed is None or parsed[0] != "clients" or parsed[2] == "cmd":
            return None
        return parsed[1]

    def parse(self, topic: str) -> tuple[str, str, str] | None:
        """Split a topic of this federation into (scope, id, leaf).

        Scope is ``"clients"``, ``"clusters"``, ``"server"`` or
        ``"broadcast"``; the id is empty for the last two. Returns ``None`` for
        a topic outside this federation or of another shape.
        """
        prefix = self.base + "/"
        if not topic.startswith(prefix):
            return None
        parts = topic[len(prefix) :].split("/")
        if len(parts) == 3 and parts[0] in ("clients", "clusters"):
            scope, ident, leaf = parts
        elif len(parts) == 2 and parts[0] in ("server", "broadcast"):
            scope, ident, leaf = parts[0], "", parts[1]
        else:
            return None
        for value in ([ident] if scope in ("clients", "clusters") else []) + [leaf]:
            try:
                check_id(value)
            except ProtocolError:
                return None
        return scope, ident, leaf
