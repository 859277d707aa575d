# cython: language_level=3
"""Compiled bit kernels of FedSketch, built as ``edge_sdk._bits``.

Two kernels, each with a pure-numpy twin in ``edge_sdk/_bits_numpy.py`` that
gives bit-identical results (the tests prove it):

* ``quantize_pack``: float class vectors -> per-vector min-max normalisation
  -> round -> flip each bit with probability P -> packed bytes, in one pass.
* ``hamming_pdist`` / ``hamming_cdist``: popcount Hamming distances between
  packed rows held as 64-bit words.

The random flips come from a counter-based generator: bit ``i`` of sketch
``b`` reads 32 bits of ``splitmix64(key + (b * ceil(n_bits / 2) + i // 2 + 1)
* GAMMA)`` (low half for even ``i``, high half for odd ``i``) with
``key = splitmix64(seed)``, and flips when that 32-bit value is below
``floor(P * 2**32)``. Any bit's decision can be recomputed from the seed and
its position alone, which is what lets numpy reproduce it exactly.

The inner loops hold no Python objects and run without the GIL. Compiler
directives come from ``setup.py`` (``FEDSKETCH_CYTHON_DEBUG=1`` turns bounds
checks back on).
"""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t
from libc.stddef cimport size_t

import numpy as np

cdef extern from *:
    """
    #include <stdint.h>
    #if defined(_MSC_VER)
    #include <intrin.h>
    static inline uint64_t fs_popcount64(uint64_t x) { return (uint64_t)__popcnt64(x); }
    #else
    static inline uint64_t fs_popcount64(uint64_t x) { return (uint64_t)__builtin_popcountll(x); }
    #endif
    #define FS_GAMMA 0x9E3779B97F4A7C15ULL
    static inline uint64_t fs_mix64(uint64_t z) {
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    static inline uint64_t fs_stream(uint64_t key, uint64_t counter) {
        return fs_mix64(key + (counter + 1ULL) * FS_GAMMA);
    }
    """
    uint64_t fs_popcount64(uint64_t x) noexcept nogil
    uint64_t fs_mix64(uint64_t z) noexcept nogil
    uint64_t fs_stream(uint64_t key, uint64_t counter) noexcept nogil

ctypedef fused floating:
    float
    double


def mix64(uint64_t z):
    """splitmix64's finaliser, exposed so tests can pin the generator."""
    return fs_mix64(z)


cdef void _quantize_pack(
    const floating[:, :, ::1] vecs,
    uint64_t threshold,
    uint64_t key,
    uint8_t[:, ::1] out,
) noexcept nogil:
    cdef Py_ssize_t n_sketch = vecs.shape[0]
    cdef Py_ssize_t n_group = vecs.shape[1]
    cdef Py_ssize_t n_dim = vecs.shape[2]
    cdef uint64_t n_bits = <uint64_t>(n_group * n_dim)
    cdef uint64_t n_pairs = (n_bits + 1) >> 1
    cdef Py_ssize_t b, g, d
    cdef double lo, hi, span, v
    cdef uint64_t idx, base, u = 0
    cdef uint32_t acc, bit, r
    for b in range(n_sketch):
        base = <uint64_t>b * n_pairs
        idx = 0
        acc = 0
        for g in range(n_group):
            lo = vecs[b, g, 0]
            hi = lo
            for d in range(1, n_dim):
                v = vecs[b, g, d]
                if v < lo:
                    lo = v
                if v > hi:
                    hi = v
            span = hi - lo
            for d in range(n_dim):
                # round((v - lo) / span) for a value in [0, 1], ties to even,
                # is 1 iff (v - lo) / span > 1/2, i.e. 2 (v - lo) > span: exact,
                # and no division. A constant vector (span 0) gives zeros.
                bit = ((vecs[b, g, d] - lo) * 2.0) > span
                if threshold != 0:
                    if (idx & 1) == 0:
                        u = fs_stream(key, base + (idx >> 1))
                        r = <uint32_t>(u & 0xFFFFFFFFULL)
                    else:
                        r = <uint32_t>(u >> 32)
                    bit ^= <uint32_t>(r < threshold)  # branch-free flip
                acc = (acc << 1) | bit
                idx += 1
                if (idx & 7) == 0:
                    out[b, (idx >> 3) - 1] = <uint8_t>acc
                    acc = 0
        if (idx & 7) != 0:
            out[b, idx >> 3] = <uint8_t>(acc << (8 - (idx & 7)))


def quantize_pack(const floating[:, :, ::1] vecs, uint64_t threshold, uint64_t seed):
    """Fused normalise-round-flip-pack of ``vecs`` (sketches, groups, dim).

    ``threshold`` is ``floor(P * 2**32)``; ``seed`` any 64-bit integer. Inputs
    are validated by ``edge_sdk.bits.quantize_pack``; this is the raw kernel.
    Returns a ``uint8`` array of shape (sketches, ceil(groups * dim / 8)).
    """
    cdef Py_ssize_t n_bits = vecs.shape[1] * vecs.shape[2]
    out = np.zeros((vecs.shape[0], (n_bits + 7) // 8), dtype=np.uint8)
    if vecs.shape[0] == 0 or n_bits == 0:
        return out
    cdef uint8_t[:, ::1] o = out
    cdef uint64_t key = fs_mix64(seed)
    with nogil:
        _quantize_pack(vecs, threshold, key, o)
    return out


def hamming_pdist(const uint64_t[:, ::1] words):
    """Condensed pairwise Hamming distances (the order of scipy's ``pdist``)."""
    cdef Py_ssize_t n = words.shape[0]
    cdef Py_ssize_t w = words.shape[1]
    out = np.empty(n * (n - 1) // 2 if n > 1 else 0, dtype=np.int32)
    cdef int32_t[::1] o = out
    cdef Py_ssize_t i, j, t, k = 0
    cdef uint64_t s
    cdef const uint64_t* a
    cdef const uint64_t* c
    if n < 2:
        return out
    with nogil:
        for i in range(n - 1):
            a = &words[i, 0]
            for j in range(i + 1, n):
                c = &words[j, 0]
                s = 0
                for t in range(w):
                    s += fs_popcount64(a[t] ^ c[t])
                o[k] = <int32_t>s
                k += 1
    return out


def hamming_cdist(const uint64_t[:, ::1] xa, const uint64_t[:, ::1] xb):
    """Hamming distances of every row of ``xa`` to every row of ``xb``."""
    cdef Py_ssize_t na = xa.shape[0]
    cdef Py_ssize_t nb = xb.shape[0]
    cdef Py_ssize_t w = xa.shape[1]
    out = np.empty((na, nb), dtype=np.int32)
    cdef int32_t[:, ::1] o = out
    cdef Py_ssize_t i, j, t
    cdef uint64_t s
    cdef const uint64_t* a
    cdef const uint64_t* c
    if na == 0 or nb == 0 or w == 0:
        out[...] = 0
        return out
    with nogil:
        for i in range(na):
            a = &xa[i, 0]
            for j in range(nb):
                c = &xb[j, 0]
                s = 0
                for t in range(w):
                    s += fs_popcount64(a[t] ^ c[t])
                o[i, j] = <int32_t>s
    return out
