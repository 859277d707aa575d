"""Block-scaled quantisers of a delta: ``sign`` (1 bit per entry) and ``int4`` (4 bits per entry).

Each tensor's entries go in blocks of :data:`BLOCK` = 256 (the last one may be shorter), each with
one float32 scale, so that a few large entries in one part of a tensor do not flatten the rest:

- ``sign``: the scale is the mean ``|x|`` of the block (computed in float64, rounded to float32
  once); each entry is its sign, and ``-scale`` or ``+scale`` comes back (a zero entry comes back as
  ``+scale``: error feedback carries the difference). signSGD with error feedback (Karimireddy et
  al. 2019), Zheng et al.'s 1-bit FedAvg (2020).
- ``int4``: the scale is ``max|x| / 7``; each entry is ``q = rint(x / scale)`` in ``[-7, 7]``
  and ``q * scale`` comes back.

The bytes of one tensor of ``n`` entries and ``b = ceil(n / 256)`` blocks, little-endian::

    sign   4 b             f32 scales (finite, >= 0, not -0.0)
           ceil(n / 8)     sign bits, bit i least significant first, 1 = negative; padding bits 0
    int4   4 b             f32 scales, as above
           ceil(n / 2)     nibbles q + 8 (1 to 15; 0 is refused), the low nibble first; an odd n ends
                           with a padding nibble 0

Encoding works through each tensor in chunks of :data:`CHUNK` entries, so its temporaries stay
small whatever the tensor's size; with ``keep_sent`` False it writes what was not sent back into
the caller's array (the error feedback's rest) and builds no dense copy of what was sent. What
:func:`decode_sign` and :func:`decode_int4` give back is, bit for bit, what the encoder sent.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..protocol import ProtocolError

__all__ = ["BLOCK", "CHUNK", "decode_int4", "decode_sign", "encode_int4", "encode_sign", "frame_int4", "int4_values"]

#: Entries per scale.
BLOCK = 256
#: Entries encoded at a time (a multiple of BLOCK and of 8).
CHUNK = 64 * BLOCK
_TINY = np.nextafter(np.float32(0), np.float32(1))


def _starts(n: int) -> np.ndarray:
    return np.arange(0, n, BLOCK)


def _spread(scales: np.ndarray, n: int) -> np.ndarray:
    """Each block's scale repeated over its entries (float32, ``n`` entries)."""
    return np.repeat(scales, BLOCK)[:n]


def _finite(name: str, x: np.ndarray) -> None:
    if x.size and not np.isfinite(x).all():
        raise ValueError(f"tensor {name!r} of the delta holds NaN or Inf")


def _encode(name: str, x: np.ndarray, keep_sent: bool, per_byte: int,
            chunk: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
            ) -> tuple[list[memoryview], np.ndarray | None]:
    """Encode ``x`` chunk by chunk: ``chunk(c)`` gives its scales, its code bytes and what comes back.

    ``per_byte`` entries go in one code byte. Returns the tensor's parts (its scales, then its code
    bytes, each written in place as the chunks come) and what was sent (None without ``keep_sent``:
    then each chunk of ``x`` becomes what was not sent).
    """
    n = x.size
    scales = np.empty(-(-n // BLOCK), dtype="<f4")
    codes = np.empty(-(-n // per_byte), dtype=np.uint8)
    sent = np.empty(n, dtype=np.float32) if keep_sent else None
    for lo in range(0, n, CHUNK):
        c = x[lo:lo + CHUNK]
        _finite(name, c)
        s, code, back = chunk(c)
        scales[lo // BLOCK:lo // BLOCK + len(s)] = s
        codes[lo // per_byte:lo // per_byte + len(code)] = code
        if keep_sent:
            sent[lo:lo + CHUNK] = back
        else:
            np.subtract(c, back, out=c)
    return [scales.data, codes.data], sent


def _sign_chunk(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    starts = _starts(c.size)
    lengths = np.diff(np.append(starts, c.size))
    s = (np.add.reduceat(np.abs(c), starts, dtype=np.float64) / lengths).astype(np.float32)
    negative = c < 0
    rep = _spread(s, c.size)
    return s, np.packbits(negative, bitorder="little"), np.where(negative, -rep, rep)


def encode_sign(name: str, x: np.ndarray, keep_sent: bool = True) -> tuple[list[memoryview], np.ndarray | None]:
    """``sign``: the parts of one flat float32 tensor, and what was sent (None and ``x`` its rest without ``keep_sent``)."""
    return _encode(name, x, keep_sent, 8, _sign_chunk)


def _int4_scales(amax: np.ndarray) -> np.ndarray:
    """``max|x| / 7`` per block, kept so that ``7 * scale`` is finite and a non-zero block has a scale."""
    scale = (amax / np.float32(7)).astype(np.float32)
    with np.errstate(over="ignore"):
        big = np.isinf(scale * np.float32(7))
    scale[big] = np.nextafter(scale[big], np.float32(0))
    scale[(scale == 0) & (amax > 0)] = _TINY
    return scale


def _int4_chunk(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = _int4_scales(np.maximum.reduceat(np.abs(c), _starts(c.size)))
    rep = _spread(s, c.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(rep > 0, np.rint(c / rep), 0)
    q = np.clip(q, -7, 7).astype(np.int8)
    nib = (q + 8).astype(np.uint8)
    if nib.size % 2:  # the tensor's last chunk, of an odd size: a padding nibble 0
        nib = np.append(nib, np.uint8(0))
    return s, nib[0::2] | (nib[1::2] << 4), np.multiply(q, rep, dtype=np.float32)


def encode_int4(name: str, x: np.ndarray, keep_sent: bool = True) -> tuple[list[memoryview], np.ndarray | None]:
    """``int4``: the parts of one flat float32 tensor, and what was sent (None and ``x`` its rest without ``keep_sent``)."""
    return _encode(name, x, keep_sent, 2, _int4_chunk)


def _read_scales(r, where: str, n: int, tail: int) -> np.ndarray:
    """The ``ceil(n / 256)`` scales, after checking that they and ``tail`` bytes more are there."""
    b = -(-n // BLOCK)
    r.need(4 * b + tail, f"{where}: {b} scales and {tail} bytes")
    scales = r.array("<f4", b, f"{where}: {b} scales").astype(np.float32)
    if b and (not np.isfinite(scales).all() or (scales < 0).any() or np.signbit(scales).any()):
        raise ProtocolError("compressed-value", f"{where}: a scale is NaN, Inf or negative")
    return scales


def decode_sign(r, where: str, n: int, method=None) -> np.ndarray:
    """One ``sign`` tensor from the reader ``r`` (:class:`edge_sdk.compress.codec._Reader`)."""
    nbytes = (n + 7) // 8
    scales = _read_scales(r, where, n, nbytes)
    signs = r.array("u1", nbytes, f"{where}: sign bits")
    if n % 8 and signs[-1] >> (n % 8):
        raise ProtocolError("compressed-value", f"{where}: padding bits set in the last sign byte")
    rep = _spread(scales, n)
    return np.where(np.unpackbits(signs, count=n, bitorder="little").view(bool), -rep, rep)


def frame_int4(r, where: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """One ``int4`` tensor's scales (float32, one per block) and packed nibbles (uint8), read and checked but
    for the nibbles' values (:func:`decode_int4` checks those; a decoder elsewhere must too)."""
    nbytes = (n + 1) // 2
    scales = _read_scales(r, where, n, nbytes)
    return scales, r.array("u1", nbytes, f"{where}: nibbles")


def decode_int4(r, where: str, n: int, method=None) -> np.ndarray:
    """One ``int4`` tensor from the reader ``r``."""
    return int4_values(*frame_int4(r, where, n), n, where)


def check_nibbles(low: np.ndarray, high: np.ndarray, n: int, where: str) -> None:
    """Refuse ``n`` entries' nibbles (the low and high halves of their bytes) with a padding nibble not 0
    (``n`` odd: the last high nibble) or a nibble 0 among the entries."""
    if n % 2 and high[-1]:
        raise ProtocolError("compressed-value", f"{where}: the padding nibble is not 0")
    if n and (low.min() == 0 or (high[: n // 2].min(initial=1) == 0)):
        raise ProtocolError("compressed-value", f"{where}: a nibble 0 (the range is 1 to 15)")


def int4_values(scales: np.ndarray, packed: np.ndarray, n: int, where: str) -> np.ndarray:
    """What ``n`` entries of packed nibbles and their blocks' scales come back as (float32), the nibbles checked."""
    nib = np.empty(2 * packed.size, dtype=np.uint8)
    nib[0::2], nib[1::2] = packed & 0x0F, packed >> 4
    check_nibbles(nib[0::2], nib[1::2], n, where)
    nib = nib[:n]
    q = nib.astype(np.int8) - np.int8(8)
    return np.multiply(q, _spread(scales, n), dtype=np.float32)
