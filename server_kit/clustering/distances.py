"""The distances the Ward dendrogram is built on: Hamming, or Hamming with each class block clipped.

A sketch is one block of ``block_bits`` bits per class. A class the client
lacks is a block of uniform noise: its bits are fair coin flips, independent
of everything, so against any other block they differ in about half of the
bits (``Bin(block_bits, 1/2)``), whatever the other block holds. With few
clients per group and most classes missing (the OCFL splits: 3 to 6 classes
of 10), these noise comparisons make most of a pair's Hamming distance and
most of its variance, and two clients of one group are not much nearer than
two of different groups.

Clipping each block's distance at ``noise_clip`` (below ``block_bits / 2``)
keeps what tells groups apart (two blocks of the same class mean differ in a
few bits, well under the clip) and flattens the noise (most noise comparisons
land at the clip, so they add a near-constant). The server needs nothing but
the sketches: it does not learn which classes a client lacks, and the sketch
is what it was.
"""

from __future__ import annotations

import numpy as np

from edge_sdk import bits as _bits

__all__ = ["block_clipped_pdist", "sketch_pdist"]

#: Rows per chunk of :func:`block_clipped_pdist` (a chunk holds rows x clients float32 matrices).
_ROWS = 512


def block_clipped_pdist(bits: np.ndarray, block_bits: int, noise_clip: int) -> np.ndarray:
    """Condensed int32 distances: the sum over blocks of ``min(Hamming of the block, noise_clip)``.

    ``bits``: 0/1 rows, shape ``(n, blocks * block_bits)``. Same order as
    :func:`scipy.spatial.distance.pdist`.
    """
    x = np.asarray(bits)
    n, n_bits = x.shape
    if n_bits % block_bits:
        raise ValueError(f"{n_bits} bits do not split into blocks of {block_bits}")
    ones = x.astype(np.float32)
    zeros = 1.0 - ones
    out = np.empty(n * (n - 1) // 2, dtype=np.int32)
    pos = 0
    for start in range(0, n, _ROWS):
        stop = min(n, start + _ROWS)
        total = np.zeros((stop - start, n), dtype=np.float32)
        for b in range(0, n_bits, block_bits):
            blk = slice(b, b + block_bits)
            h = ones[start:stop, blk] @ zeros[:, blk].T
            h += zeros[start:stop, blk] @ ones[:, blk].T
            np.minimum(h, noise_clip, out=h)
            total += h
        for i in range(start, stop):  # row i's pairs (i, j > i), in pdist order
            row = total[i - start, i + 1:]
            out[pos:pos + row.size] = np.rint(row)
            pos += row.size
    return out


def sketch_pdist(packed: np.ndarray, n_bits: int, block_bits: int | None = None,
                 noise_clip: int | None = None) -> np.ndarray:
    """The condensed distances of packed sketches: Hamming (compiled popcount), or block-clipped when asked."""
    if noise_clip is None:
        return _bits.hamming_pdist(packed, n_bits)
    return block_clipped_pdist(_bits.unpack_bits(packed, n_bits), int(block_bits), int(noise_clip))
