# cython: language_level=3
"""Compiled bit kernels of FedSketch, built as ``edge_sdk._bits``.

Two kernels, each with a pure-numpy twin in ``edge_sdk/_bits_numpy.py`` that
gives bit-identical results (the tests prove it):

* ``quantize_pack``: float class vectors -> per-vector min-max normalisation
  -> round -> flip each bit with probability P -> packed bytes, in one pass
  over the input: each sketch is rounded into a small 0/1 byte buffer (which
  stays in L1 cache), flipped and packed before the next sketch is read.
  Rounding works in the input's own precision (float32 or float64), as numpy
  does: bit = ``2 * (v - min) > max - min``, which is ``round((v - min) /
  (max - min))`` with ties to even, without a division.
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
from libc.stdlib cimport free, malloc

import numpy as np

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(_MSC_VER) && !defined(restrict)
    #define restrict __restrict
    #endif
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
    /* Round one vector to 0/1 bytes after min-max normalisation:
       bit = 2 (v - min) > (max - min), in the vector's own precision.
       restrict tells the compiler the bytes written do not alias the floats
       read, so the loops vectorise. */
    #define FS_ROUND_BODY                                                   \
        T lo = row[0], hi = row[0];                                         \
        for (Py_ssize_t d = 1; d < n; d++) {                                \
            T v = row[d];                                                   \
            lo = v < lo ? v : lo;                                           \
            hi = v > hi ? v : hi;                                           \
        }                                                                   \
        T span = hi - lo;                                                   \
        for (Py_ssize_t d = 0; d < n; d++)                                  \
            out[d] = (uint8_t)(((row[d] - lo) * 2) > span);
    static inline void fs_round_f32(const float* restrict row, Py_ssize_t n,
                                    uint8_t* restrict out) {
        typedef float T;
        FS_ROUND_BODY
    }
    static inline void fs_round_f64(const double* restrict row, Py_ssize_t n,
                                    uint8_t* restrict out) {
        typedef double T;
        FS_ROUND_BODY
    }
    /* Xor the flips into n_pairs pairs of 0/1 bytes: pair j reads generator
       output `counter0 + j`, its low 32 bits decide the first byte, its high
       32 bits the second; flip when the 32-bit draw is below `threshold`. */
    static inline void fs_flip_pairs(uint8_t* restrict bits, Py_ssize_t n_pairs,
                                     uint64_t key, uint64_t counter0,
                                     uint64_t threshold) {
        for (Py_ssize_t j = 0; j < n_pairs; j++) {
            uint64_t u = fs_stream(key, counter0 + (uint64_t)j);
            bits[2 * j] ^= (uint8_t)((u & 0xFFFFFFFFULL) < threshold);
            bits[2 * j + 1] ^= (uint8_t)((u >> 32) < threshold);
        }
    }
    /* Eight 0/1 bytes -> one byte, first byte in the most significant bit. */
    static inline uint8_t fs_pack8(const uint8_t* p) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ || defined(_M_X64) || defined(_M_ARM64)
        uint64_t x;
        memcpy(&x, p, 8);
        return (uint8_t)((x * 0x8040201008040201ULL) >> 56);
    #else
        return (uint8_t)((p[0] << 7) | (p[1] << 6) | (p[2] << 5) | (p[3] << 4)
                         | (p[4] << 3) | (p[5] << 2) | (p[6] << 1) | p[7]);
    #endif
    }
    """
    uint64_t fs_popcount64(uint64_t x) noexcept nogil
    uint64_t fs_mix64(uint64_t z) noexcept nogil
    uint64_t fs_stream(uint64_t key, uint64_t counter) noexcept nogil
    uint8_t fs_pack8(const uint8_t* p) noexcept nogil
    void fs_flip_pairs(uint8_t* bits, Py_ssize_t n_pairs, uint64_t key,
                       uint64_t counter0, uint64_t threshold) noexcept nogil
    void fs_round_f32(const float* row, Py_ssize_t n, uint8_t* out) noexcept nogil
    void fs_round_f64(const double* row, Py_ssize_t n, uint8_t* out) noexcept nogil

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
    uint8_t* buf,
    uint8_t[:, ::1] out,
) noexcept nogil:
    # Three simple loops per sketch instead of one serial one, so the compiler
    # can keep many independent operations in flight: (1) round every value to
    # a 0/1 byte in ``buf``, (2) xor the flips, two per generator call, (3)
    # pack eight bytes into one. ``buf`` holds n_bits + 1 bytes.
    cdef Py_ssize_t n_sketch = vecs.shape[0]
    cdef Py_ssize_t n_group = vecs.shape[1]
    cdef Py_ssize_t n_dim = vecs.shape[2]
    cdef Py_ssize_t n_bits = n_group * n_dim
    cdef Py_ssize_t n_pairs = (n_bits + 1) >> 1
    cdef Py_ssize_t n_full = n_bits >> 3
    cdef Py_ssize_t b, g, d, k
    cdef uint8_t acc
    for b in range(n_sketch):
        for g in range(n_group):
            # min-max normalise and round (ties to even): see fs_round_* above;
            # a constant vector (span 0) gives zeros
            if floating is float:
                fs_round_f32(&vecs[b, g, 0], n_dim, buf + g * n_dim)
            else:
                fs_round_f64(&vecs[b, g, 0], n_dim, buf + g * n_dim)
        if threshold != 0:
            buf[n_bits] = 0  # the odd tail's partner, never packed
            fs_flip_pairs(buf, n_pairs, key, <uint64_t>b * <uint64_t>n_pairs, threshold)
        for k in range(n_full):
            out[b, k] = fs_pack8(buf + 8 * k)
        if n_bits & 7:
            acc = 0
            for d in range(8 * n_full, n_bits):
                acc |= <uint8_t>(buf[d] << (7 - (d & 7)))
            out[b, n_full] = acc


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
    cdef uint8_t* buf = <uint8_t*>malloc(n_bits + 1)
    if buf == NULL:
        raise MemoryError(f"cannot allocate {n_bits + 1} bytes")
    try:
        with nogil:
            _quantize_pack(vecs, threshold, key, buf, o)
    finally:
        free(buf)
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
