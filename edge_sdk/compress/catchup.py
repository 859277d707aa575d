"""One exact merged catch-up: a model from an old version to the current one, bit for bit.

A device that holds version ``u`` of a model several versions behind gets one body that turns its
float32 copy into the server's current one exactly. Each float32 is mapped to an ordered integer
(``ord``, a bijection of the 32-bit patterns whose order follows the float order: a pattern ``b``
with the sign bit clear is ``b``, one with it set is ``-(b & 0x7fffffff) - 1``, so ``+0.0 -> 0``
and ``-0.0 -> -1``); per entry the difference ``d = ord(new) - ord(old)`` (exact in int64) is
zigzag-coded (``2 d`` for ``d >= 0``, ``-2 d - 1`` otherwise) and the values are bit-packed per
block of 256 entries, in the bits of the block's largest value. Small changes of weights cost few
bits: a weight moved by one part in a thousand moves its ``ord`` by about 2**13.

The body, little-endian::

    offset  size  field
    0       2     magic b"FU"
    2       1     version (1)
    3       4     u32 number of tensors (the receiver's spec must have as many)

then per tensor, in sorted name order (names and shapes come from the receiver's spec, as in
:mod:`.codec`), with ``n`` entries in ``B = ceil(n / 256)`` blocks::

    B     one u8 width w per block, 0 to 33: the bit length of the block's largest zigzag value
    4     u32 m, the packed bytes: ceil(sum over blocks of w * block length / 8)
    m     the values, block after block, w bits each, least significant bit first; padding bits 0

and the body ends exactly there. A tensor whose entries did not change costs ``B + 4`` bytes
(width 0 everywhere, ``m = 0``). Every block but a tensor's last starts on a 64-bit boundary of
its packed bytes (256 w bits), which is what lets :func:`_pack` and :func:`_unpack` work on
uint64 words, one loop over the 64 positions of a word group per width, none per entry.

The receiver trusts nothing: the widths and ``m`` are read and checked before anything of their
size is built, and every refusal raises :class:`~edge_sdk.protocol.ProtocolError` with one of the
reasons ``compressed-header`` (magic, version, a body shorter than the header),
``compressed-count`` (a number of tensors other than the spec's, an ``m`` other than the widths
give), ``compressed-length`` (a body that ends early or runs on) and ``compressed-value`` (a width
above 33 or above the bits of its block's largest value, padding bits set, a result outside the
finite float32s: NaN and Inf never come out).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..protocol import ProtocolError
from .codec import _check_spec

__all__ = ["apply_catchup", "catchup_body", "catchup_size"]

MAGIC = b"FU"
VERSION = 1
BLOCK = 256
MAX_WIDTH = 33
_HEADER = struct.Struct("<2sBI")
_U32 = struct.Struct("<I")
_ORD_MIN = -0x7F800000  #: ord(-max finite float32)
_ORD_MAX = 0x7F7FFFFF  #: ord(+max finite float32)
_WORDS = BLOCK // 64  # uint64 words per block and bit of width


# -- ordered integers and zigzag ------------------------------------------------


def _ord(x: np.ndarray) -> np.ndarray:
    """float32 -> ordered int64 (``-0.0 -> -1``, ``+0.0 -> 0``)."""
    i = x.reshape(-1).view(np.int32)
    return np.where(i < 0, i ^ np.int32(0x7FFFFFFF), i).astype(np.int64)


def _from_ord(o: np.ndarray) -> np.ndarray:
    """ordered int64 (within the finite range) -> float32; the inverse of :func:`_ord`."""
    i = o.astype(np.int32)
    return np.where(i < 0, i ^ np.int32(0x7FFFFFFF), i).view(np.float32)


def _zigzag(d: np.ndarray) -> np.ndarray:
    return ((d << 1) ^ (d >> 63)).view(np.uint64)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> np.uint64(1)).view(np.int64) ^ -(z & np.uint64(1)).view(np.int64)


def _bit_length(v: np.ndarray) -> np.ndarray:
    """Bit lengths of uint64 values below 2**53 (0 for 0), exact through float64's exponent."""
    return np.frexp(v.astype(np.float64))[1].astype(np.int64)


def _blocks(z: np.ndarray) -> np.ndarray:
    """Zigzag values padded with zeros to whole blocks, shape (B, 256)."""
    nb = -(-len(z) // BLOCK)
    padded = np.zeros(nb * BLOCK, dtype=np.uint64)
    padded[: len(z)] = z
    return padded.reshape(nb, BLOCK)


def _packed_bytes(widths: np.ndarray, n: int) -> int:
    """``m``: the packed bytes of ``n`` entries in blocks of these widths."""
    if n == 0:
        return 0
    bits = BLOCK * int(widths[:-1].sum()) + int(widths[-1]) * (n - BLOCK * (len(widths) - 1))
    return -(-bits // 8)


# -- packing ----------------------------------------------------------------------


def _pack(blocks: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """uint64 words of the blocks' values, block ``k`` at word ``4 * sum(widths[:k])``."""
    starts = _WORDS * np.concatenate(([0], np.cumsum(widths[:-1])))
    words = np.zeros(_WORDS * int(widths.sum()), dtype=np.uint64)
    for w in np.unique(widths[widths > 0]).tolist():
        sel = np.flatnonzero(widths == w)
        groups = blocks[sel].reshape(-1, 64)  # 64 values of w bits fill w words
        out = np.zeros((len(groups), w), dtype=np.uint64)
        for j in range(64):
            word, shift = divmod(j * w, 64)
            out[:, word] |= groups[:, j] << np.uint64(shift)
            if shift + w > 64:
                out[:, word + 1] |= groups[:, j] >> np.uint64(64 - shift)
        words[(starts[sel, None] + np.arange(_WORDS * w)).reshape(-1)] = out.reshape(-1)
    return words


def _unpack(words: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pack` (``words`` padded with zeros past the data), shape (B, 256)."""
    starts = _WORDS * np.concatenate(([0], np.cumsum(widths[:-1])))
    blocks = np.zeros((len(widths), BLOCK), dtype=np.uint64)
    for w in np.unique(widths[widths > 0]).tolist():
        sel = np.flatnonzero(widths == w)
        got = words[starts[sel, None] + np.arange(_WORDS * w)].reshape(-1, w)
        mask = np.uint64((1 << w) - 1)
        groups = np.empty((len(got), 64), dtype=np.uint64)
        for j in range(64):
            word, shift = divmod(j * w, 64)
            v = got[:, word] >> np.uint64(shift)
            if shift + w > 64:
                v |= got[:, word + 1] << np.uint64(64 - shift)
            groups[:, j] = v & mask
        blocks[sel] = groups.reshape(-1, BLOCK)
    return blocks


# -- encoding ---------------------------------------------------------------------


def _pairs(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, old, new) in sorted name order, checked: same names and shapes, finite float32."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        raise ValueError("old and new must be mappings of tensor names to float32 arrays")
    if set(old) != set(new):
        raise ValueError(f"old and new must hold the same tensors; only in old: {sorted(set(old) - set(new))}, "
                         f"only in new: {sorted(set(new) - set(old))}")
    out = []
    for name in sorted(old):
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        a, b = np.asarray(old[name]), np.asarray(new[name])
        if a.dtype != np.float32 or b.dtype != np.float32:
            raise ValueError(f"tensor {name!r}: float32 only, got {a.dtype} and {b.dtype}")
        if a.shape != b.shape:
            raise ValueError(f"tensor {name!r}: shapes {a.shape} and {b.shape} differ")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"tensor {name!r} holds NaN or Inf")
        out.append((name, a, b))
    return out


def _encode(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The blocks of zigzag differences of one tensor and their widths."""
    blocks = _blocks(_zigzag(_ord(np.ascontiguousarray(b)) - _ord(np.ascontiguousarray(a))))
    return blocks, _bit_length(blocks.max(axis=1, initial=0))


def catchup_body(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> bytes:
    """The body that turns ``old`` into ``new`` exactly (:func:`apply_catchup`).

    Parameters
    ----------
    old, new : mapping of str to numpy.ndarray
        The same names and shapes, float32, finite.

    Returns
    -------
    bytes
        The body (format in this module's docstring).

    Raises
    ------
    ValueError
        Other names or shapes, another dtype, NaN or Inf.
    """
    pairs = _pairs(old, new)
    parts = [_HEADER.pack(MAGIC, VERSION, len(pairs))]
    for _, a, b in pairs:
        blocks, widths = _encode(a, b)
        m = _packed_bytes(widths, a.size)
        words = _pack(blocks, widths).astype("<u8", copy=False)
        parts += [widths.astype(np.uint8).tobytes(), _U32.pack(m), words.tobytes()[:m]]
    return b"".join(parts)


def catchup_size(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> int:
    """``len(catchup_body(old, new))``, without packing anything (the same checks and ValueErrors)."""
    size = _HEADER.size
    for _, a, b in _pairs(old, new):
        widths = _encode(a, b)[1]
        size += len(widths) + _U32.size + _packed_bytes(widths, a.size)
    return size


# -- decoding ---------------------------------------------------------------------


def _read(body: bytes, pos: int, size: int, what: str) -> int:
    """``pos`` after checking that ``size`` bytes are left there for ``what``."""
    left = len(body) - pos
    if size > left:
        raise ProtocolError("compressed-length", f"{what} needs {size} bytes, {left} left")
    return pos


def _decode_tensor(body: bytes, pos: int, where: str, n: int) -> tuple[np.ndarray, int]:
    """The zigzag values of one tensor (length ``n``) and the position after it."""
    nb = -(-n // BLOCK)
    pos = _read(body, pos, nb + _U32.size, f"{where}: {nb} widths and m")
    widths = np.frombuffer(body, dtype=np.uint8, count=nb, offset=pos).astype(np.int64)
    if nb and widths.max() > MAX_WIDTH:
        raise ProtocolError("compressed-value", f"{where}: a block width of {int(widths.max())} (at most {MAX_WIDTH})")
    (m,) = _U32.unpack_from(body, pos + nb)
    expected = _packed_bytes(widths, n)
    if m != expected:
        raise ProtocolError("compressed-count", f"{where}: m is {m}, its block widths give {expected}")
    pos = _read(body, pos + nb + _U32.size, m, f"{where}: {m} packed bytes")
    packed = np.frombuffer(body, dtype=np.uint8, count=m, offset=pos)
    tail = (BLOCK * int(widths[:-1].sum()) + int(widths[-1]) * (n - BLOCK * (nb - 1))) % 8 if nb else 0
    if tail and packed[-1] >> tail:
        raise ProtocolError("compressed-value", f"{where}: padding bits set in the last packed byte")
    words = np.zeros(_WORDS * int(widths.sum()) + 1, dtype="<u8")
    words.view(np.uint8)[:m] = packed
    blocks = _unpack(words.astype(np.uint64, copy=False), widths)
    if nb and (_bit_length(blocks.max(axis=1)) != widths).any():
        raise ProtocolError("compressed-value", f"{where}: a block width above the bits of its largest value")
    return blocks.reshape(-1)[:n], pos + m


def apply_catchup(old: Mapping[str, np.ndarray], body: bytes,
                  spec: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, np.ndarray]:
    """The new version: ``old`` with a body of :func:`catchup_body` applied, bit for bit.

    Parameters
    ----------
    old : mapping of str to numpy.ndarray
        The copy held, float32, finite, with the spec's names and shapes; never modified.
    body : bytes
        From a peer: nothing in it is trusted.
    spec : mapping of name to (shape, dtype)
        The names and shapes the receiver expects (float dtypes).

    Returns
    -------
    dict of str to numpy.ndarray
        New float32 arrays, in sorted name order.

    Raises
    ------
    ProtocolError
        A body that breaks the format; reasons in this module's docstring.
    ValueError
        A bad spec, or ``old`` that does not fit it (the caller's error, not the peer's).
    """
    shapes = _check_spec(spec)
    held = {}
    for name, shape in shapes.items():
        a = np.asarray(old[name]) if isinstance(old, Mapping) and name in old else None
        if a is None or a.dtype != np.float32 or a.shape != shape or not np.isfinite(a).all():
            raise ValueError(f"old must hold tensor {name!r} as finite float32 of shape {shape}")
        held[name] = np.ascontiguousarray(a)
    body = bytes(body)
    if len(body) < _HEADER.size:
        raise ProtocolError("compressed-header",
                            f"body of {len(body)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, count = _HEADER.unpack_from(body, 0)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError("compressed-header", f"not a catch-up (magic {magic!r}, version {version})")
    if count != len(shapes):
        raise ProtocolError("compressed-count", f"body holds {count} tensors, the spec {len(shapes)}")
    pos, out = _HEADER.size, {}
    for name, shape in shapes.items():
        where = f"tensor {name!r}"
        z, pos = _decode_tensor(body, pos, where, math.prod(shape))
        o = _ord(held[name]) + _unzigzag(z)
        if o.size and (o.min() < _ORD_MIN or o.max() > _ORD_MAX):
            raise ProtocolError("compressed-value", f"{where}: a result outside the finite float32 range")
        out[name] = _from_ord(o).reshape(shape)
    if pos != len(body):
        raise ProtocolError("compressed-length", f"{len(body) - pos} trailing bytes after the last tensor")
    return out
