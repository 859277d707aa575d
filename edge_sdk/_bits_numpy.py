"""Pure-numpy twin of the compiled kernels in ``ext/bits.pyx``.

Same arguments, same results, bit for bit: the tests run both on the same
inputs. Used when the extension is not built, or when
``FEDSKETCH_PURE_NUMPY=1`` asks for it.
"""

from __future__ import annotations

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_LOW32 = np.uint64(0xFFFFFFFF)

if hasattr(np, "bitwise_count"):  # numpy >= 2.0

    def _popcount(words: np.ndarray) -> np.ndarray:
        return np.bitwise_count(words)

else:  # pragma: no cover - exercised only with numpy 1.x
    _TABLE = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)

    def _popcount(words: np.ndarray) -> np.ndarray:
        as_bytes = np.ascontiguousarray(words).view(np.uint8)
        counts = _TABLE[as_bytes].reshape(*words.shape, 8)
        return counts.sum(axis=-1, dtype=np.uint64)


def mix64(z: int | np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 values (wrapping arithmetic)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _stream(key: np.uint64, counters: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return mix64(key + (counters + np.uint64(1)) * _GAMMA)


def quantize_pack(vecs: np.ndarray, threshold: int, seed: int) -> np.ndarray:
    """Normalise, round, flip and pack ``vecs`` (sketches, groups, dim)."""
    n_sketch, n_group, n_dim = vecs.shape
    n_bits = n_group * n_dim
    if n_sketch == 0 or n_bits == 0:
        return np.zeros((n_sketch, (n_bits + 7) // 8), dtype=np.uint8)
    # Arithmetic in the input's dtype, like the compiled kernel.
    # round((x - lo) / span) with ties to even == 2 (x - lo) > span (exact, span 0 -> 0)
    lo = vecs.min(axis=2, keepdims=True)
    span = vecs.max(axis=2, keepdims=True) - lo
    bits = (vecs - lo) * 2 > span
    bits = bits.reshape(n_sketch, n_bits)
    if threshold:
        idx = np.arange(n_bits, dtype=np.uint64)
        n_pairs = np.uint64((n_bits + 1) >> 1)
        base = np.arange(n_sketch, dtype=np.uint64)[:, None] * n_pairs
        u = _stream(mix64(np.uint64(seed)), base + (idx >> np.uint64(1)))
        r = (u >> ((idx & np.uint64(1)) * np.uint64(32))) & _LOW32
        bits ^= r < np.uint64(threshold)
    return np.packbits(bits, axis=1)


def hamming_pdist(words: np.ndarray) -> np.ndarray:
    """Condensed pairwise Hamming distances on uint64 words (scipy's order)."""
    n = words.shape[0]
    if n < 2:
        return np.empty(0, dtype=np.int32)
    parts = [_popcount(words[i + 1 :] ^ words[i]).sum(axis=1) for i in range(n - 1)]
    return np.concatenate(parts).astype(np.int32)


def hamming_cdist(xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
    """Hamming distances of every row of ``xa`` to every row of ``xb``."""
    out = np.empty((xa.shape[0], xb.shape[0]), dtype=np.int32)
    for i in range(xa.shape[0]):
        out[i] = _popcount(xb ^ xa[i]).sum(axis=1)
    return out
