"""Integers mod ``2**m`` packed with exactly ``m`` bits each: :func:`pack_bits`, :func:`unpack_bits`, :func:`to_signed`.

Entry ``i`` takes bits ``i m`` to ``(i + 1) m - 1`` of the byte string read as one little-endian
number (bit ``k`` is bit ``k mod 8`` of byte ``k div 8``), its least significant bit first;
``ceil(n m / 8)`` bytes, the unused top bits of the last byte zero. ``m`` of 8, 16 or 32 is plain
little-endian ``uint8``, ``uint16`` or ``uint32``.
"""

from __future__ import annotations

import numpy as np

from .errors import SecureError

__all__ = ["pack_bits", "packed_size", "to_signed", "unpack_bits"]

_PLAIN = {8: "<u1", 16: "<u2", 32: "<u4"}


def _check_m(m: int) -> None:
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= 32:
        raise ValueError(f"m must be an integer in [1, 32], got {m!r}")


def packed_size(n: int, m: int) -> int:
    """The bytes of ``n`` entries of ``m`` bits: ``ceil(n m / 8)``."""
    return -(-n * m // 8)


def pack_bits(values: np.ndarray, m: int) -> bytes:
    """``values`` (integers in ``[0, 2**m)``, one dimension) with ``m`` bits each.

    Raises
    ------
    ValueError
        A value outside ``[0, 2**m)``, or ``values`` not a flat integer array.
    """
    _check_m(m)
    v = np.asarray(values)
    if v.ndim != 1 or not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"values must be a flat integer array, got {v.dtype} of shape {v.shape}")
    if v.size and (int(v.min()) < 0 or int(v.max()) >= 1 << m):
        raise ValueError(f"values must lie in [0, 2**{m})")
    if m in _PLAIN:
        return v.astype(_PLAIN[m]).tobytes()
    bits = np.unpackbits(v.astype("<u4").view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    return np.packbits(bits[:, :m].reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: bytes, n: int, m: int) -> np.ndarray:
    """The ``n`` entries of ``m`` bits packed in ``data``, as ``uint32``.

    Raises
    ------
    SecureError
        ``"length"``: ``data`` is not ``ceil(n m / 8)`` bytes; ``"padding"``: the unused bits of the
        last byte are not zero.
    """
    _check_m(m)
    size = packed_size(n, m)
    if len(data) != size:
        raise SecureError("length", f"{n} entries of {m} bits are {size} bytes, got {len(data)}")
    raw = np.frombuffer(data, dtype=np.uint8)
    if m in _PLAIN:
        return raw.view(_PLAIN[m]).astype(np.uint32)
    spare = 8 * size - n * m
    if spare and int(raw[-1]) >> (8 - spare):
        raise SecureError("padding", f"the {spare} unused bits of the last byte are not zero")
    bits = np.unpackbits(raw, bitorder="little")[:n * m].reshape(n, m)
    wide = np.zeros((n, 32), dtype=np.uint8)
    wide[:, :m] = bits
    return np.packbits(wide, axis=1, bitorder="little").view("<u4").reshape(n).astype(np.uint32)


def to_signed(values: np.ndarray, m: int) -> np.ndarray:
    """Integers mod ``2**m`` read as ``m``-bit two's complement numbers, as ``int64``."""
    _check_m(m)
    v = np.asarray(values).astype(np.int64) & ((1 << m) - 1)
    return np.where(v >= 1 << (m - 1), v - (1 << m), v)
