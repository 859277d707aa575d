"""``rsign``, ``rtern`` and ``rint2``: 2, 3 or 4 levels per entry after a random rotation (DRIVE and EDEN).

Plain ``sign`` (:mod:`.blocks`) sends each entry's sign and its block's mean magnitude. Its error is
the same on every device that trained alike: the devices of one cluster start from the same model
and learn similar changes, so the server's average keeps their common error instead of averaging it
away. These codecs first rotate each block of the tensor by a random orthogonal matrix, a
Walsh-Hadamard transform after random signs (a randomised Hadamard transform), which makes the
block's entries near Gaussian whatever the tensor's own distribution, then quantise the rotated
entries with one scale per block chosen so that the estimate is unbiased over the rotations
(Vargaftik et al. 2021, DRIVE; 2022, EDEN):

- ``rsign``: each rotated entry's sign, scale ``s = ||y||^2 / ||y||_1``; ``s * sign`` comes back.
  One device's error is about 0.57 of its change's energy.
- ``rtern``: each rotated entry as -1, 0 or 1 (0 where ``|y|`` is below ``0.6120`` times the
  block's root mean square, the best ternary quantiser of a Gaussian), scale ``s = ||y||^2 / <y, q>``;
  5 entries in a byte (1.6 bits). About 0.23 of the energy.
- ``rint2``: each rotated entry as -3, -1, 1 or 3 (1 where ``|y|`` is below ``0.9957`` times the
  block's root mean square, the best uniform 4-level quantiser of a Gaussian), scale
  ``s = ||y||^2 / <y, q>``; ``s * q`` comes back. About 0.13 of the energy.

Each device's rotation comes from a seed hashed from its own delta, so two devices' errors are
independent and the average over the ``k`` devices of a cluster divides the error's energy by ``k``.

A tensor of ``n`` entries is padded with zeros to ``m``, the next multiple of 16, and cut into
blocks whose sizes are powers of 4, so that the normalisation ``1 / sqrt(b)`` is a power of two
and exact: as many blocks of :data:`BLOCK` = 4,096 as fit, then at most three each of 1,024, 256,
64 and 16 (:func:`blocks_of`; 48,000 entries: 11 of 4,096, 2 of 1,024, 3 of 256, 2 of 64). Its
bytes::

    8          u64 seed of the rotation's signs: those of entries 65,536 j to 65,536 (j + 1) are
               the bits of SHAKE-128 of b"FZ-rotation", the seed and j (u32), bit i least
               significant first, 1 = negate
    4 B        f32 scales, one per block in order (finite, >= 0, not -0.0, at most
               2**127 / (3 sqrt(b)) for a block of b)
    m / 8      rsign: the rotated entries' sign bits, bit i least significant first, 1 = negative
    ceil(m/5)  rtern: their codes q + 1, five to a byte: entry i is digit i mod 5 of byte i div 5
               in base 3, least significant first (a byte is at most 242; the digits past m are 0)
    m / 4      rint2: their codes (q + 3) / 2, 2 bits each, entry i in bits 2 (i mod 4) and up

What comes back is ``D H (s * q) / sqrt(b)``, its first ``n`` entries: the transform of the
integers ``q`` is a vector of integers (every sum exact in float32, whatever order a matrix product
adds in), times ``s / sqrt(b)`` (exact), times the rotation's signs, so the encoder, the decoder and
any machine get the same bits.
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

from ..protocol import ProtocolError

__all__ = ["BLOCK", "blocks_of", "code_bytes", "decode_rotated", "encode_rotated", "padded"]

#: The largest block (a power of 4).
BLOCK = 4096
_SIZES = (4096, 1024, 256, 64, 16)
#: Entries per window of the rotation's signs (and at most per batch of blocks encoded at once).
_WINDOW = 65536
_SEED = b"FZ-rotation"
#: The thresholds over the block's root mean square: rint2's between the levels 1 and 3, rtern's between 0 and 1.
_STEP = 0.9957
_DEAD = 0.6120


def padded(n: int) -> int:
    """``m``: ``n`` rounded up to a multiple of 16 (0 stays 0)."""
    return -(-n // 16) * 16


def blocks_of(n: int) -> list[tuple[int, int, int]]:
    """The runs of equal blocks of a tensor of ``n`` entries: ``(start, block, count)``, none across a window."""
    m, runs, at = padded(n), [], 0
    for b in _SIZES:
        count = (m - at) // b
        while count:  # blocks of 4,096: a run per window
            take = min(count, (_WINDOW - at % _WINDOW) // b)
            runs.append((at, b, take))
            at, count = at + take * b, count - take
    return runs


def _inv_sqrt(b: int) -> np.float32:
    return np.float32(1.0 / math.sqrt(b))  # exact: b is a power of 4


def _max_scale(b: int) -> np.float32:
    return np.float32(2.0 ** 127 / (3 * math.sqrt(b)))


def _hadamard(y: np.ndarray) -> np.ndarray:
    """The unnormalised Walsh-Hadamard transform (Sylvester's order) of each row of ``y`` (float32), in place.

    Two butterflies at a time (the row's length is a power of 4), in a fixed order of additions: the
    same bits on every machine, and exact for whole numbers.
    """
    rows, b = y.shape
    h = 1
    while h < b:
        v = y.reshape(rows, b // (4 * h), 4, h)
        a, c, d, e = v[:, :, 0, :], v[:, :, 1, :], v[:, :, 2, :], v[:, :, 3, :]
        s0, d0, s1, d1 = a + c, a - c, d + e, d - e
        np.add(s0, s1, out=a)
        np.add(d0, d1, out=c)
        np.subtract(s0, s1, out=d)
        np.subtract(d0, d1, out=e)
        h *= 4
    return y


def _seed_of(x: np.ndarray) -> int:
    """The rotation's seed: a hash of the tensor's size and first 65,536 entries (two devices' changes differ there)."""
    h = hashlib.blake2b(x.size.to_bytes(8, "little"), digest_size=8)
    h.update(np.ascontiguousarray(x[:_WINDOW]).data)  # a view of a contiguous tensor: nothing copied
    return int.from_bytes(h.digest(), "little")


@functools.cache
def _sylvester(r: int) -> np.ndarray:
    """The ``r x r`` Hadamard matrix of Sylvester's order, float32 (read only: it is shared)."""
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < r:
        h = np.block([[h, h], [h, -h]])
    h.flags.writeable = False
    return h


def _back(q: np.ndarray, scales: np.ndarray, flips: np.ndarray, b: int) -> np.ndarray:
    """What comes back for the integer codes ``q`` (float32, rows of ``b``), their scales and the flips.

    The transform of a block is ``H_r X H_r`` with ``X`` the block as an ``r x r`` matrix (``b = r^2``,
    ``H_b = H_r (x) H_r``): every sum on the way is a whole number below ``3 b``, exact in float32
    whatever order the matrix product adds in.
    """
    r = math.isqrt(b)
    h = _sylvester(r)
    y = np.matmul(np.matmul(h, q.reshape(-1, r, r)), h)
    y *= (scales * _inv_sqrt(b))[:, None, None]
    out = y.reshape(-1)
    np.negative(out, out=out, where=flips)
    return out


#: Entries per byte of the codes as encoded and decoded batch by batch (rtern's: one code a byte, before packing).
_PER_BYTE = {2: 8, 3: 1, 4: 4}


def code_bytes(m: int, levels: int) -> int:
    """The code bytes of ``m`` entries (a multiple of 16) in ``levels`` levels (2, 3 or 4)."""
    return {2: m // 8, 3: -(-m // 5), 4: m // 4}[levels]


def _quantise(rows: np.ndarray, energy: np.ndarray, levels: int) -> np.ndarray:
    """The integer codes of the rotated rows (``energy``: each row's sum of squares): +-1; -1, 0, 1; or -3, -1, 1, 3."""
    q = np.where(rows < 0, np.float32(-1), np.float32(1))
    if levels > 2:
        rms = np.sqrt(energy / rows.shape[1]).astype(np.float32)
        cut = np.abs(rows) > (np.float32(_STEP if levels == 4 else _DEAD) * rms)[:, None]
        if levels == 4:
            q[cut] *= np.float32(3)
        else:
            q[~cut] = 0
    return q


def _pack(q: np.ndarray, levels: int) -> np.ndarray:
    """Signs or 2-bit codes, as bytes; rtern's codes ``q + 1`` one per byte (packed five to a byte at the end)."""
    if levels == 2:
        return np.packbits(q.reshape(-1) < 0, bitorder="little")
    if levels == 3:
        return (q.reshape(-1) + np.float32(1)).astype(np.uint8)
    c = ((q.reshape(-1, 4) + np.float32(3)) / np.float32(2)).astype(np.uint8)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def _unpack(codes: np.ndarray, levels: int) -> np.ndarray:
    if levels == 2:
        return np.where(np.unpackbits(codes, bitorder="little").view(bool), np.float32(-1), np.float32(1))
    if levels == 3:
        return codes.astype(np.float32) - np.float32(1)
    c = np.stack([(codes >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)
    return c.astype(np.float32) * np.float32(2) - np.float32(3)


_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _trits_to_bytes(digits: np.ndarray) -> np.ndarray:
    """Codes 0, 1, 2 five to a byte (base 3, the first least significant), the last byte padded with 0."""
    pad = np.zeros(-(-digits.size // 5) * 5, dtype=np.uint8)
    pad[:digits.size] = digits
    return (pad.reshape(-1, 5) * _POW3).sum(axis=1, dtype=np.uint16).astype(np.uint8)


def _bytes_to_trits(packed: np.ndarray, m: int, where: str) -> np.ndarray:
    """The ``m`` codes of rtern's bytes, refusing a byte above 242 and padding digits other than 0."""
    if packed.size and packed.max() > 242:
        raise ProtocolError("compressed-value", f"{where}: a byte above 242 (five codes of three levels)")
    digits = ((packed[:, None] // _POW3) % 3).reshape(-1)
    if digits[m:].any():
        raise ProtocolError("compressed-value", f"{where}: the padding codes are not 0")
    return digits[:m]


def _batches(n: int):
    """Per batch of blocks: its window, its first entry, its block, its blocks, its first block.

    A batch is at most a sixteenth of the tensor (at least one block of 4,096, at most a window), so
    that its temporaries stay a small part of the tensor while a large tensor goes in few steps.
    """
    k = 0
    most = min(_WINDOW, max(BLOCK, n // 16 // BLOCK * BLOCK))
    for lo, b, count in blocks_of(n):
        step = max(1, most // b)
        for i in range(0, count, step):
            c = min(step, count - i)
            yield lo // _WINDOW, lo + i * b, b, c, k
            k += c


def _flip_source(seed: int, m: int):
    """The raw bytes of each window's flips, made once per window as the batches ask for them."""
    made: dict[int, bytes] = {}

    def flips(window: int, lo: int, hi: int) -> np.ndarray:
        if window not in made:
            made.clear()
            wlo = window * _WINDOW
            made[window] = hashlib.shake_128(_SEED + seed.to_bytes(8, "little") + window.to_bytes(4, "little")
                                             ).digest(min(_WINDOW, m - wlo) // 8)
        raw = np.frombuffer(made[window], dtype=np.uint8)[(lo - window * _WINDOW) // 8:(hi - window * _WINDOW) // 8]
        return np.unpackbits(raw, bitorder="little").view(bool)

    return flips


class _TritWriter:
    """rtern's codes, packed five to a byte as the batches come (at most four codes wait for the next batch)."""

    def __init__(self, out: np.ndarray) -> None:
        self.out, self.pos, self.pending = out, 0, np.zeros(0, dtype=np.uint8)

    def write(self, digits: np.ndarray) -> None:
        both = np.concatenate([self.pending, digits])
        full = both.size // 5 * 5
        self.out[self.pos:self.pos + full // 5] = _trits_to_bytes(both[:full])
        self.pos += full // 5
        self.pending = both[full:]

    def close(self) -> None:
        if self.pending.size:
            self.out[self.pos:self.pos + 1] = _trits_to_bytes(self.pending)


def encode_rotated(name: str, x: np.ndarray, keep_sent: bool = True,
                   levels: int = 2) -> tuple[list[bytes | memoryview], np.ndarray | None]:
    """``rsign`` (``levels`` 2), ``rtern`` (3) or ``rint2`` (4): the parts of one flat float32 tensor, and what was sent.

    Without ``keep_sent`` the second value is None and ``x`` is left holding what was not sent. The
    tensor goes a batch of blocks at a time (:func:`_batches`): its temporaries are about a
    sixteenth of its size, or less.
    """
    n = x.size
    if n and not np.isfinite(x).all():
        raise ValueError(f"tensor {name!r} of the delta holds NaN or Inf")
    m = padded(n)
    seed = _seed_of(x)
    scales = np.empty(sum(count for _, _, count in blocks_of(n)), dtype="<f4")
    codes = np.empty(code_bytes(m, levels), dtype=np.uint8)
    trits = _TritWriter(codes) if levels == 3 else None
    per = _PER_BYTE[levels]
    sent = np.empty(n, dtype=np.float32) if keep_sent else None
    flips = _flip_source(seed, m)
    for window, lo, b, count, k in _batches(n):
        hi = lo + b * count
        y = np.zeros(hi - lo, dtype=np.float32)
        y[:max(0, min(n, hi) - lo)] = x[lo:hi]
        f = flips(window, lo, hi)
        np.negative(y, out=y, where=f)
        with np.errstate(over="ignore", invalid="ignore"):  # checked just below
            rows = _hadamard(y.reshape(-1, b))
            rows *= _inv_sqrt(b)
        if not np.isfinite(rows).all():
            raise ValueError(f"tensor {name!r} of the delta holds values too large to rotate")
        energy = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
        q = _quantise(rows, energy, levels)
        dot = np.einsum("ij,ij->i", rows, q, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(dot > 0, energy / dot, 0.0).astype(np.float32)
        if (s > _max_scale(b)).any():
            raise ValueError(f"tensor {name!r} of the delta holds values too large to rotate")
        scales[k:k + count] = s
        if trits is not None:
            trits.write(_pack(q, levels))
        else:
            codes[lo // per:hi // per] = _pack(q, levels)
        back = _back(q, s, f, b)[:max(0, min(n, hi) - lo)]
        if keep_sent:
            sent[lo:lo + back.size] = back
        else:
            x[lo:lo + back.size] -= back
    if trits is not None:
        trits.close()
    return [seed.to_bytes(8, "little"), scales.data, codes.data], sent


def decode_rotated(r, where: str, n: int, levels: int) -> np.ndarray:
    """One ``rsign`` (``levels`` 2), ``rtern`` (3) or ``rint2`` (4) tensor from the reader ``r`` (:class:`.reader.Reader`)."""
    m, runs = padded(n), blocks_of(n)
    nb, size = sum(count for _, _, count in runs), code_bytes(m, levels)
    r.need(8 + 4 * nb + size, f"{where}: seed, {nb} scales and {size} code bytes")
    seed = int(r.array("<u8", 1, f"{where}: seed")[0])
    scales = r.array("<f4", nb, f"{where}: {nb} scales").astype(np.float32)
    limit = np.concatenate([np.full(count, _max_scale(b), np.float32) for _, b, count in runs]) if runs else scales
    if nb and (not np.isfinite(scales).all() or (scales < 0).any() or np.signbit(scales).any()
               or (scales > limit).any()):
        raise ProtocolError("compressed-value", f"{where}: a scale is NaN, Inf, negative or too large")
    codes = r.array("u1", size, f"{where}: codes")
    if levels == 3:
        codes = _bytes_to_trits(codes, m, where)
    per = _PER_BYTE[levels]
    out = np.empty(n, dtype=np.float32)
    flips = _flip_source(seed, m)
    for window, lo, b, count, k in _batches(n):
        hi = lo + b * count
        q = _unpack(codes[lo // per:hi // per], levels)
        back = _back(q, scales[k:k + count], flips(window, lo, hi), b)
        out[lo:min(n, hi)] = back[:max(0, min(n, hi) - lo)]
    return out
