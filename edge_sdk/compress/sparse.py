"""Top-k and STC tensors: the positions of the largest magnitudes, their index block, and the values.

:func:`select` finds the ``k`` entries of largest ``|x|`` (among equal magnitudes the lowest
indices) chunk by chunk, without a copy of the tensor: the magnitudes' float32 bits, read as
unsigned integers, sort as the magnitudes do, so a radix select (three histograms of 11, 10 and 10
bits, :data:`CHUNK` entries at a time) finds the k-th largest, and a last pass takes every larger
entry and the lowest-indexed ties. Its temporaries are a chunk and a few thousand counts, whatever
the tensor's size.

:func:`encode_sparse` writes one tensor's fields (the layout is in :mod:`.codec`'s docstring): the
index gaps as LEB128 varints (:mod:`.varints`) or Rice codes (:mod:`.golomb`), whichever is fewer
bytes, then float32 values (top-k) or ``mu`` and sign bits (STC). Without ``keep_sent`` it takes
what it sent from the tensor's own entries (error feedback's rest) and builds no dense copy.
:func:`decode_sparse` reads one back, checking every size before it builds anything of that size.
"""

from __future__ import annotations

import struct

import numpy as np

from ..protocol import ProtocolError
from .blocks import CHUNK
from .golomb import MAX_B, best_parameter, max_rice_bytes, read_rice, rice
from .reader import Reader, read_scalar
from .varints import read_varints, varints

__all__ = ["SPARSE_VERSION", "decode_sparse", "encode_sparse", "select"]

#: The version of top-k and STC bodies, whose index block says its coding (version 1: LEB128 only, still read).
SPARSE_VERSION = 2
_LEB128, _RICE = 0, 1
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")
_F32 = struct.Struct("<f")
_ABS = np.uint32(0x7FFFFFFF)
#: (shift, width) of the radix digits of a magnitude's 31 bits, the highest first.
_DIGITS = ((20, 11), (10, 10), (0, 10))


def _keys(x: np.ndarray, lo: int) -> np.ndarray:
    """The magnitudes of ``x[lo:lo + CHUNK]`` as uint32 bits (ordered as the magnitudes are; no NaN)."""
    return x[lo:lo + CHUNK].view(np.uint32) & _ABS


def _threshold(x: np.ndarray, k: int) -> tuple[int, int]:
    """The k-th largest magnitude's bits ``t`` (0 < k <= n), and how many entries of magnitude ``t`` are taken."""
    prefix, need = 0, k
    for shift, width in _DIGITS:
        counts = np.zeros(1 << width, dtype=np.int64)
        top = shift + width
        for lo in range(0, x.size, CHUNK):
            key = _keys(x, lo)
            if top < 31:
                key = key[(key >> top) == prefix]
            counts += np.bincount((key >> shift) & ((1 << width) - 1), minlength=1 << width)
        at_least = np.cumsum(counts[::-1])  # at_least[j]: entries whose digit is >= the largest digit - j
        j = int(np.searchsorted(at_least, need))
        need -= int(at_least[j - 1]) if j else 0
        prefix = (prefix << width) | ((1 << width) - 1 - j)
    return prefix, need


def select(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending int64 indices of the ``k`` largest ``|x|`` of a flat float32 ``x`` without NaN.

    Among equal magnitudes the lowest indices are taken (``-0.0`` and ``0.0`` are equal).
    """
    n = x.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    t, ties = _threshold(x, k)
    out = []
    for lo in range(0, n, CHUNK):
        key = _keys(x, lo)
        take = key > t
        if ties:
            equal = np.flatnonzero(key == t)[:ties]
            take[equal] = True
            ties -= len(equal)
        out.append(np.flatnonzero(take) + lo)
    return np.concatenate(out).astype(np.int64, copy=False)


def scatter(n: int, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A float32 array of ``n`` zeros with ``values`` at ``idx``."""
    out = np.zeros(n, dtype=np.float32)
    out[idx] = values
    return out


def _index_parts(gaps: np.ndarray) -> list[bytes]:
    """The coding byte(s), ``m`` and the index block: Rice where it is fewer bytes than LEB128."""
    block = varints(gaps)
    if len(gaps):
        b, size = best_parameter(gaps)
        if size < len(block):
            block = rice(gaps, b)
            return [bytes([_RICE, b]), _U32.pack(len(block)), block.tobytes()]
    return [bytes([_LEB128]), _U32.pack(len(block)), block.tobytes()]


def encode_sparse(x: np.ndarray, k: int, stc: bool, keep_sent: bool) -> tuple[list[bytes], np.ndarray | None]:
    """One flat, finite float32 tensor (``k`` kept, ``n < 2**32``): its parts and what was sent.

    Without ``keep_sent`` what was sent is subtracted from ``x`` at the kept positions (``x``
    becomes the rest) and None is returned in its place.
    """
    idx = select(x, k)
    gaps = (np.diff(idx, prepend=0) if k else idx).astype(np.uint64)
    parts = [_U32.pack(k), *_index_parts(gaps)]
    values = x[idx]
    if stc:
        mu = np.float32(np.mean(np.abs(values), dtype=np.float64)) if k else np.float32(0)
        negative = values < 0
        parts += [_F32.pack(mu), np.packbits(negative, bitorder="little").tobytes()]
        values = np.where(negative, -mu, mu).astype(np.float32)  # as decoded
    else:
        parts.append(values.astype("<f4", copy=False).tobytes())
    if keep_sent:
        return parts, scatter(x.size, idx, values)
    x[idx] -= values
    return parts, None


def _read_gaps(r: Reader, where: str, n: int, stc: bool) -> tuple[int, np.ndarray]:
    """k and the index gaps: LEB128 (a version 1 body, or coding 0) or Rice (coding 1), sizes checked first."""
    (k,) = r.unpack(_U32, f"{where}: k")
    if k > n:
        raise ProtocolError("compressed-count", f"{where}: k {k} > {n} entries")
    coding, b = _LEB128, 0
    if r.version == SPARSE_VERSION:
        (coding,) = r.unpack(_U8, f"{where}: index coding")
        if coding == _RICE:
            (b,) = r.unpack(_U8, f"{where}: Rice parameter")
        if coding not in (_LEB128, _RICE) or b > MAX_B:
            raise ProtocolError("compressed-index", f"{where}: index coding {coding} (parameter {b}) is unknown")
    (m,) = r.unpack(_U32, f"{where}: m")
    low, high = (k, 5 * k) if coding == _LEB128 else (0, max_rice_bytes(n, k, b))
    if not low <= m <= high:
        raise ProtocolError("compressed-count",
                            f"{where}: index block of {m} bytes for k {k} (must be {low} to {high})")
    tail = 4 + (k + 7) // 8 if stc else 4 * k
    r.need(m + tail, f"{where}: {m} index bytes and {tail} bytes of values")
    block = r.array("u1", m, where)
    return k, read_varints(block, k, where) if coding == _LEB128 else read_rice(block, k, b, where)


def decode_sparse(r: Reader, where: str, n: int, stc: bool) -> np.ndarray:
    """One top-k (``stc`` False) or STC tensor of ``n`` entries from the reader ``r``, as float32."""
    k, gaps = _read_gaps(r, where, n, stc)
    if k > 1 and not gaps[1:].all():
        raise ProtocolError("compressed-index", f"{where}: a gap of 0 (a duplicate index)")
    idx = np.cumsum(gaps)
    if k and idx[-1] >= n:
        raise ProtocolError("compressed-index", f"{where}: index {int(idx[-1])} out of range for {n} entries")
    if not stc:
        values = r.array("<f4", k, f"{where}: {k} values")
        if not np.isfinite(values).all():
            raise ProtocolError("compressed-value", f"{where}: a value is NaN or Inf")
        return scatter(n, idx, values)
    mu = read_scalar(r, f"{where}: mu")
    signs = r.array("u1", (k + 7) // 8, f"{where}: sign bits")
    if k % 8 and signs[-1] >> (k % 8):
        raise ProtocolError("compressed-value", f"{where}: padding bits set in the last sign byte")
    return scatter(n, idx, np.where(np.unpackbits(signs, count=k, bitorder="little").view(bool), -mu, mu))
