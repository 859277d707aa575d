"""Compressed model deltas: 8-bit, 4-bit and 1-bit quantisation, top-k and sparse ternary (STC) bodies.

A device sends the change of its model, not the model. :func:`encode_delta` turns a delta (named
float32 arrays) into a body and also returns ``sent``, exactly what :func:`decode_delta` gives
back on the other side, bit for bit, so that error feedback (:mod:`.feedback`) can carry the rest.

- ``int8``: every entry as ``q = rint(x / scale)`` in ``[-127, 127]``, ``scale = max|x| / 127``
  per tensor; ``q * scale`` comes back.
- ``topk``: per tensor the ``k = ceil(fraction * n)`` entries of largest magnitude (among equal
  magnitudes the lowest indices), as gap-coded indices and float32 values.
- ``stc``: Sattler et al.'s sparse ternary compression: the same positions, one sign bit each, and
  one magnitude ``mu`` per tensor, the mean ``|x|`` of the kept entries; ``+-mu`` comes back.
- ``int4`` and ``sign``: 4 bits and 1 bit per entry with one scale per block of 256 entries
  (:mod:`.blocks`).
- ``rsign``, ``rtern`` and ``rint2``: 1, 1.6 and 2 bits per entry after a seeded random rotation of
  each block of up to 4,096 entries, with an unbiased scale per block (:mod:`.rotated`).

Every body is little-endian::

    offset  size  field
    0       2     magic b"FZ"
    2       1     version: 2 for topk and stc (1, their LEB128-only layout, is still read), else 1
    3       1     method (1 = int8, 2 = topk, 3 = stc, 4 = sign, 5 = int4)
    4       4     u32 number of tensors (the receiver's spec must have as many)

then per tensor, in sorted name order (names and shapes are not on the wire: the receiver's spec
gives them, and so ``n``, the number of entries)::

    int8   4     f32 scale (finite, >= 0, not -0.0)
           n     int8 q (-128 is refused)
    topk   4     u32 k, 0 <= k <= n
           1     index coding: 0 = LEB128, 1 = Rice (then 1 byte: its parameter b <= 31)
           4     u32 m, the bytes of the index block: k to 5 k (LEB128), at most what k gaps within
                 n entries can need (Rice, :mod:`.golomb`)
           m     the first index, then each gap to the previous index (>= 1), whichever is fewer
                 bytes: LEB128 varints (1 to 5 bytes each, no needless final zero byte), or Rice:
                 the k quotients g >> b in unary (that many 1 bits, then a 0), then the k
                 remainders in b bits each, least significant bit first, padding bits 0
           4 k   f32 values (finite)
    stc    k, the coding, m and the index block, as topk, then
           4     f32 mu (finite, >= 0, not -0.0)
           ceil(k / 8)  sign bits, bit i least significant first, 1 = negative; padding bits 0
    sign   4 B   f32 scales, one per block of 256 entries, B = ceil(n / 256) (finite, >= 0, not -0.0)
           ceil(n / 8)  sign bits, as stc's: -scale or +scale of the entry's block comes back
    int4   4 B   f32 scales, as sign
           ceil(n / 2)  nibbles q + 8 (1 to 15), the low nibble first; an odd n ends with a
                 padding nibble 0: q * scale of the entry's block comes back

    rsign, rtern, rint2: the layout of :mod:`.rotated` (a seed, a scale per block, the codes)

and the body ends exactly there. ``k = 0`` is accepted for any ``n`` (nothing sent for that
tensor: ``m = 0``, no values; STC still carries ``mu``); the encoder writes it only for empty
tensors. One tensor of 1,000 entries takes 8 + 1,004 bytes as int8, 8 + 16 + 500 as int4, 8 + 16
+ 125 as sign; as ``topk:0.01`` (k = 10) 8 + 9 + m + 40 and as ``stc:0.01`` 8 + 9 + m + 4 + 2,
with m from 10 to 20 index bytes (LEB128; Rice adds its parameter byte and takes about 9 bits a
position at 1 %).

Encoding works :data:`~.blocks.CHUNK` entries at a time where the method allows (int8, sign,
int4; top-k and STC select their positions chunk by chunk, :mod:`.sparse`), so its temporaries stay
small; with ``keep_sent`` False no dense copy of what was sent is built at all.

The decoder trusts nothing: each fixed field is read only after the bytes left are checked, counts
are checked against the spec and the bytes left before anything of their size is built, and every
refusal raises :class:`~edge_sdk.protocol.ProtocolError` with one of the reasons
``compressed-header``, ``compressed-method``, ``compressed-length``, ``compressed-count``,
``compressed-index`` and ``compressed-value``.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocol import ProtocolError
from ..validation import check_choice, check_int, check_number
from .blocks import CHUNK, decode_int4, decode_sign, encode_int4, encode_sign
from .reader import Reader as _Reader
from .reader import read_scalar as _read_scalar
from .rotated import decode_rotated, encode_rotated
from .sparse import SPARSE_VERSION, decode_sparse, encode_sparse

__all__ = ["Compression", "Method", "decode_delta", "encode_delta", "keep_count"]

MAGIC = b"FZ"
VERSION = 1
_HEADER = struct.Struct("<2sBBI")
_F32 = struct.Struct("<f")
_MAX_U32 = 0xFFFFFFFF


class Method(str, enum.Enum):
    """How a delta is compressed (the ``--compress`` choices)."""

    NONE = "none"  #: whole float32 weights as safetensors, as without compression (never encoded here)
    INT8 = "int8"  #: every entry in 8 bits, one scale per tensor
    TOPK = "topk"  #: the largest ``fraction`` of the entries per tensor, indices and float32 values
    STC = "stc"  #: the same positions, one sign bit each, one magnitude per tensor
    SIGN = "sign"  #: one bit per entry, one magnitude per block of 256 (:mod:`.blocks`)
    INT4 = "int4"  #: 4 bits per entry, one scale per block of 256 (:mod:`.blocks`)
    RSIGN = "rsign"  #: one bit per entry after a random rotation, one scale per block of 1,024 (:mod:`.rotated`)
    RINT2 = "rint2"  #: two bits per entry (-3, -1, 1, 3) after a random rotation, as rsign (:mod:`.rotated`)
    RTERN = "rtern"  #: -1, 0 or 1 per entry (1.6 bits) after a random rotation, as rsign (:mod:`.rotated`)


_CODES = {Method.INT8: 1, Method.TOPK: 2, Method.STC: 3, Method.SIGN: 4, Method.INT4: 5, Method.RSIGN: 6, Method.RINT2: 7,
          Method.RTERN: 8}
_SPARSE = (Method.TOPK, Method.STC)
_SPARSE_CODES = (2, 3)
_NAMES = tuple(m.value for m in Method)
_DEFAULT_FRACTION = 0.01
_CLI_FORMS = "'none', 'int8', 'int4', 'sign', 'rsign', 'rtern', 'rint2', 'topk[:fraction]' or 'stc[:fraction]'"


@dataclass(frozen=True)
class Compression:
    """A compression setting: the method and, for top-k and STC, the share kept.

    Parameters
    ----------
    method : Method or str
        ``"none"``, ``"int8"``, ``"int4"``, ``"sign"``, ``"rsign"``, ``"rtern"``, ``"rint2"``, ``"topk"``
        or ``"stc"``.
    fraction : float
        Share of the entries kept per tensor, in ``(0, 1]``, for top-k and STC. It is checked for
        every method, then set to the default 0.01 for the methods other than top-k and STC,
        which ignore it, so that equal settings compare equal (``Compression("int8", 0.5) ==
        Compression("int8")``).
    """

    method: Method = Method.NONE
    fraction: float = _DEFAULT_FRACTION

    def __post_init__(self) -> None:
        method = check_choice(self.method, "compression method", _NAMES)
        object.__setattr__(self, "method", Method(method))
        fraction = check_number(self.fraction, "compression fraction", low=0.0, low_open=True, high=1.0)
        object.__setattr__(self, "fraction", fraction if self.method in _SPARSE else _DEFAULT_FRACTION)

    @property
    def enabled(self) -> bool:
        """Whether deltas are compressed at all (the method is not ``none``)."""
        return self.method is not Method.NONE

    def to_meta(self) -> dict[str, Any]:
        """As JSON meta: ``{"method": "topk", "fraction": 0.01}`` (fraction only for topk and stc)."""
        if self.method in _SPARSE:
            return {"method": self.method.value, "fraction": self.fraction}
        return {"method": self.method.value}

    @classmethod
    def from_meta(cls, d: Any) -> Compression:
        """Read :meth:`to_meta`'s form back: ``method``, and ``fraction`` with topk and stc only.

        ValueError for anything else (not a mapping, other keys, a bad method or fraction).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"compression meta must be a mapping, got {type(d).__name__}")
        extra = sorted(set(d) - {"method", "fraction"}, key=str)
        if extra or "method" not in d:
            raise ValueError("compression meta must have 'method' and at most 'fraction', "
                             f"got keys {sorted(d, key=str)}")
        method = check_choice(d["method"], "compression method", _NAMES)
        if (method in ("topk", "stc")) != ("fraction" in d):
            raise ValueError(f"compression meta {dict(d)!r}: a fraction goes with topk and stc, "
                             "and only with them")
        return cls(Method(method), d.get("fraction", _DEFAULT_FRACTION))

    @classmethod
    def parse(cls, text: str) -> Compression:
        """Read the command-line form: ``none``, ``int8``, ``int4``, ``sign``, ``topk``, ``topk:0.01``, ``stc:0.005``.

        Spaces around the text are ignored; the method is lower case; topk and
        stc without a fraction keep 0.01.

        Raises
        ------
        ValueError
            An unknown method, a fraction after a method other than topk and stc, a fraction not a number in (0, 1].
        """
        if not isinstance(text, str):
            raise ValueError(f"compression must be text ({_CLI_FORMS}), got {text!r}")
        name, colon, value = text.strip().partition(":")
        if name not in _NAMES or (colon and name not in ("topk", "stc")):
            raise ValueError(f"compression must be {_CLI_FORMS}, got {text!r}")
        if not colon:
            return cls(Method(name))
        try:
            fraction = float(value)
        except ValueError:
            raise ValueError("compression fraction must be a number in (0, 1], "
                             f"got {value!r} in {text!r}") from None
        return cls(Method(name), fraction)

    def __str__(self) -> str:
        """The command-line form; topk and stc always with their fraction (``parse(str(c)) == c``)."""
        return f"{self.method.value}:{self.fraction!r}" if self.method in _SPARSE else self.method.value


def keep_count(n: int, fraction: float) -> int:
    """How many of ``n`` entries top-k and STC keep: ``ceil(fraction * n)``, at least 1 when ``n > 0``."""
    n = check_int(n, "n", 0)
    fraction = check_number(fraction, "fraction", low=0.0, low_open=True, high=1.0)
    return 0 if n == 0 else min(n, max(1, math.ceil(fraction * n)))


# -- encoding -----------------------------------------------------------------


def _as_float32(name: Any, value: Any) -> np.ndarray:
    """A delta tensor as float32 (other float types cast, anything else refused)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"tensor {name!r} has dtype {arr.dtype}; a delta is floating point")
    return arr.astype(np.float32, copy=False)


def _finite_max(name: str, x: np.ndarray) -> np.float32:
    """``max|x|`` (0 when empty, never -0.0), refusing NaN and Inf."""
    top = max(x.max(), -x.min()) if x.size else np.float32(0)
    if not np.isfinite(top):
        raise ValueError(f"tensor {name!r} of the delta holds NaN or Inf")
    return np.float32(abs(top))


def _int8_scale(amax: np.float32) -> np.float32:
    """``max|x| / 127``, kept so that ``127 * scale`` is finite and a non-zero tensor has a scale."""
    scale = np.float32(amax / np.float32(127))
    if np.isinf(scale * np.float32(127)):  # 127 * scale must stay finite on the way back
        scale = np.nextafter(scale, np.float32(0))
    if scale == 0 and amax > 0:  # magnitudes below 127 * the smallest subnormal: that is the scale
        scale = np.nextafter(np.float32(0), np.float32(1))
    return scale


def _encode_int8(name: str, x: np.ndarray, comp: Compression, keep_sent: bool) -> tuple[list[Any], np.ndarray | None]:
    """``int8``, :data:`CHUNK` entries at a time (the scale is the whole tensor's)."""
    scale = _int8_scale(_finite_max(name, x))
    q = np.zeros(x.size, dtype=np.int8)
    sent = np.empty(x.size, dtype=np.float32) if keep_sent else None
    for lo in range(0, x.size if scale > 0 else 0, CHUNK):
        c = x[lo:lo + CHUNK]
        f = np.rint(c / scale)
        q[lo:lo + CHUNK] = np.clip(f, -127, 127, out=f)
        back = np.multiply(q[lo:lo + CHUNK], scale, dtype=np.float32)  # as decoded
        if keep_sent:
            sent[lo:lo + CHUNK] = back
        else:
            np.subtract(c, back, out=c)
    if keep_sent and not scale > 0:
        sent.fill(0)
    return [_F32.pack(scale), q.data], sent


def _encode_sparse(name: str, x: np.ndarray, comp: Compression, keep_sent: bool) -> tuple[list[Any], np.ndarray | None]:
    n = x.size
    if n > _MAX_U32:
        raise ValueError(f"tensor {name!r} has {n} entries; top-k and STC count at most 2**32 - 1")
    _finite_max(name, x)
    return encode_sparse(x, keep_count(n, comp.fraction), comp.method is Method.STC, keep_sent)


#: Each method's encoder of one flat float32 tensor: its parts and what was sent (None without
#: ``keep_sent``: then the tensor's array is left holding what was not sent).
_ENCODERS: dict[Method, Callable[[str, np.ndarray, Compression, bool], tuple[list[Any], np.ndarray | None]]] = {
    Method.INT8: _encode_int8, Method.TOPK: _encode_sparse, Method.STC: _encode_sparse,
    Method.SIGN: lambda name, x, comp, keep_sent: encode_sign(name, x, keep_sent),
    Method.INT4: lambda name, x, comp, keep_sent: encode_int4(name, x, keep_sent),
    Method.RSIGN: lambda name, x, comp, keep_sent: encode_rotated(name, x, keep_sent, 2),
    Method.RTERN: lambda name, x, comp, keep_sent: encode_rotated(name, x, keep_sent, 3),
    Method.RINT2: lambda name, x, comp, keep_sent: encode_rotated(name, x, keep_sent, 4)}


def encode_delta(delta: Mapping[str, np.ndarray], comp: Compression, *,
                 keep_sent: bool = True) -> tuple[bytes, dict[str, np.ndarray] | None]:
    """Compress a model delta into a body.

    Parameters
    ----------
    delta : mapping of str to ndarray
        The change per tensor; float32 (other float types are cast), finite.
    comp : Compression
        The method (not ``none``) and, for top-k and STC, the share kept.
    keep_sent : bool
        False: no dense copy of what was sent is built; instead each tensor of ``delta`` (which
        must then be writeable, C-contiguous float32) is overwritten with what was not sent
        (``delta - sent``: error feedback's rest), and ``sent`` is None.

    Returns
    -------
    body : bytes
        The body, in the format of this module's docstring.
    sent : dict of str to ndarray, or None
        Exactly what :func:`decode_delta` gives back for ``body``: new float32 arrays of the same
        names (in sorted order) and shapes (None without ``keep_sent``).

    Raises
    ------
    ValueError
        Method ``none``, an empty mapping, a tensor that is not floating point or holds NaN or
        Inf, a top-k or STC tensor of 2**32 entries or more; without ``keep_sent``, a tensor
        that cannot be overwritten.
    """
    if not isinstance(comp, Compression):
        raise ValueError(f"comp must be a Compression, got {type(comp).__name__}")
    if not comp.enabled:
        raise ValueError("encode_delta needs a compression method, got 'none' "
                         "(send the whole weights instead)")
    if not delta:
        raise ValueError("no tensors in the delta to encode")
    version = SPARSE_VERSION if comp.method in _SPARSE else VERSION
    parts = [_HEADER.pack(MAGIC, version, _CODES[comp.method], len(delta))]
    sent = {}
    for name in sorted(delta, key=str):
        x = _as_float32(name, delta[name])
        if not keep_sent and (x is not delta[name] or not x.flags.c_contiguous or not x.flags.writeable):
            raise ValueError(f"tensor {name!r}: encoding in place needs a writeable C-contiguous float32 array")
        tensor_parts, values = _ENCODERS[comp.method](name, x.reshape(-1), comp, keep_sent)
        parts += tensor_parts
        if keep_sent:
            sent[name] = values.reshape(x.shape)
    return b"".join(parts), sent if keep_sent else None


# -- decoding -----------------------------------------------------------------


def frame_int8(r: _Reader, where: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """One ``int8`` tensor's scale (a float32 array of one) and entries (int8), read and checked but for the
    entries' values (:func:`_decode_int8` refuses -128; a decoder elsewhere must too)."""
    r.need(4 + n, f"{where}: scale and {n} int8 entries")
    scale = _read_scalar(r, f"{where}: scale")
    return np.array([scale], dtype=np.float32), r.array("i1", n, f"{where}: {n} int8 entries")


def _decode_int8(r: _Reader, where: str, n: int, method: Method) -> np.ndarray:
    return int8_values(*frame_int8(r, where, n), where)


def check_int8(q: np.ndarray, where: str) -> None:
    """Refuse int8 entries holding -128 (the range is symmetric)."""
    if q.size and q.min() == -128:
        raise ProtocolError("compressed-value", f"{where}: int8 entry -128 (the range is [-127, 127])")


def int8_values(scales: np.ndarray, q: np.ndarray, where: str) -> np.ndarray:
    """What int8 entries and their tensor's scale come back as (float32), the entries checked."""
    check_int8(q, where)
    return np.multiply(q, scales[0], dtype=np.float32)


def _decode_sparse(r: _Reader, where: str, n: int, method: Method) -> np.ndarray:
    return decode_sparse(r, where, n, method is Method.STC)


_DECODERS: dict[Method, Callable[[_Reader, str, int, Method], np.ndarray]] = {
    Method.INT8: _decode_int8, Method.TOPK: _decode_sparse, Method.STC: _decode_sparse,
    Method.SIGN: decode_sign, Method.INT4: decode_int4,
    Method.RSIGN: lambda r, where, n, method: decode_rotated(r, where, n, 2),
    Method.RTERN: lambda r, where, n, method: decode_rotated(r, where, n, 3),
    Method.RINT2: lambda r, where, n, method: decode_rotated(r, where, n, 4)}


def _check_spec(spec: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"spec must be a non-empty mapping of name to (shape, dtype), got {spec!r}")
    shapes = {}
    for name in sorted(spec, key=str):
        try:
            shape, dtype = spec[name]
            shapes[name] = tuple(check_int(d, "dimension", 0) for d in shape)
            floating = np.issubdtype(np.dtype(dtype), np.floating)
        except (TypeError, ValueError) as e:
            raise ValueError(f"spec entry {name!r} must be (shape, dtype), got {spec[name]!r}: {e}") from None
        if not floating:
            raise ValueError(f"spec entry {name!r} has dtype {dtype}; a delta is floating point")
    return shapes


def add_change(held: np.ndarray, change: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``held + change``, the one way a decoded change is added (the server's copies and every device's agree).

    A floating tensor becomes ``np.add`` in float32. An integer tensor (a
    counter such as BatchNorm's ``num_batches_tracked``, whose change travels
    as float32 like any other) gets the change rounded to the nearest integer
    and keeps its dtype; a lossy codec may round a counter's change off by a
    few, the same way on every side. ``out`` (float tensors only) may be
    ``change`` itself.
    """
    held = np.asarray(held)
    if np.issubdtype(held.dtype, np.integer):
        return np.add(held, np.rint(change).astype(held.dtype, copy=False), dtype=held.dtype)
    return np.add(held, change, out=out, dtype=np.float32)


def decode_delta(body: bytes, spec: Mapping[str, tuple[tuple[int, ...], str]],
                 method: Method) -> dict[str, np.ndarray]:
    """Read a body back against the receiver's spec.

    Parameters
    ----------
    body : bytes
        A body of :func:`encode_delta`, from a peer: nothing in it is trusted.
    spec : mapping of name to (shape, dtype)
        The names and shapes the receiver expects; the dtype must be a float type (the delta
        always comes back as float32).
    method : Method
        The method the receiver expects (not ``none``).

    Returns
    -------
    dict of str to ndarray
        New writable float32 arrays, in sorted name order.

    Raises
    ------
    ProtocolError
        A body that breaks the format; reasons in this module's docstring.
    ValueError
        A bad spec or method (the caller's error, not the peer's).
    """
    r, shapes = open_body(body, spec, method)
    method = Method(method)
    out = {}
    for name, shape in shapes.items():
        out[name] = _DECODERS[method](r, f"tensor {name!r}", math.prod(shape), method).reshape(shape)
    if r.pos != len(r.body):
        raise ProtocolError("compressed-length", f"{len(r.body) - r.pos} trailing bytes after the last tensor")
    return out


def open_body(body: bytes, spec: Mapping[str, tuple[tuple[int, ...], str]],
              method: Method) -> tuple[_Reader, dict[str, tuple[int, ...]]]:
    """A body's header checked against the spec and method: a reader at the first tensor, and the shapes
    in the body's order (sorted names). :func:`decode_delta` and the server's decoders on a GPU start here;
    each then reads every tensor and checks that the body ends exactly after the last."""
    method = Method(check_choice(method, "method", _NAMES[1:]))
    shapes = _check_spec(spec)
    body = bytes(body)
    if len(body) < _HEADER.size:
        raise ProtocolError("compressed-header",
                            f"body of {len(body)} bytes is shorter than the {_HEADER.size}-byte header")
    r = _Reader(body)
    magic, version, code, count = r.unpack(_HEADER, "header")
    r.version = version
    if magic != MAGIC or not (version == VERSION or (version == SPARSE_VERSION and code in _SPARSE_CODES)):
        raise ProtocolError("compressed-header", f"not a compressed delta (magic {magic!r}, version {version})")
    if code != _CODES[method]:
        raise ProtocolError("compressed-method", f"method byte {code}, expected {_CODES[method]} ({method.value})")
    if count != len(shapes):
        raise ProtocolError("compressed-header", f"body holds {count} tensors, the spec {len(shapes)}")
    return r, shapes
