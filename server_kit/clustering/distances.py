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

The clip, unless given, is :func:`default_noise_clip`: half a standard
deviation of the noise below its mean, ``round(d / 2 - sqrt(d) / 4)`` for
blocks of ``d`` bits (9 of 20). In a model of the pair distances (``m``
shared class blocks that differ in ``q d`` bits, the rest noise), it keeps
84 to 100 % of the best clip's signal-to-noise ratio at 20 bits, and 1.3 to
1.7 times the unclipped one (``m`` 2 to 5, ``q`` 0.15 to 0.25); a clip at
the mean (``d / 2``) flattens too little, one a whole deviation below clips
blocks of the same class (``benchmarks/RESULTS.md``).

:func:`sketch_pdist` and :func:`bits_pdist` take a ``device`` (default
``"auto"``): many clients and a CUDA GPU send the work to torch, with the same
distances (:mod:`server_kit.clustering.on_device`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edge_sdk import bits as _bits

__all__ = ["bits_pdist", "block_clipped_pdist", "default_noise_clip", "sketch_pdist"]

#: Rows per chunk of :func:`block_clipped_pdist` (a chunk holds a few rows x clients matrices).
_ROWS = 512


def default_noise_clip(block_bits: int) -> int:
    """The clip of a block of ``block_bits`` bits: half a deviation of its noise distance below the mean."""
    return max(1, round(block_bits / 2 - math.sqrt(block_bits) / 4))


def block_clipped_pdist(bits: np.ndarray, block_bits: int, noise_clip: int) -> np.ndarray:
    """Condensed int32 distances: the sum over blocks of ``min(Hamming of the block, noise_clip)``.

    ``bits``: 0/1 rows, shape ``(n, blocks * block_bits)``. Same order as
    :func:`scipy.spatial.distance.pdist`. Blocks of up to 64 bits are compared
    as integers (XOR and popcount); longer ones by a matrix product.
    """
    x = np.asarray(bits)
    n, n_bits = x.shape
    if n_bits % block_bits:
        raise ValueError(f"{n_bits} bits do not split into blocks of {block_bits}")
    blocks = n_bits // block_bits
    block_distances = _xor_blocks(x, block_bits) if block_bits <= 64 else _matmul_blocks(x, block_bits)
    out = np.empty(n * (n - 1) // 2, dtype=np.int32)
    pos = 0
    for start in range(0, n, _ROWS):
        stop = min(n, start + _ROWS)
        total = np.zeros((stop - start, n), dtype=np.min_scalar_type(blocks * noise_clip))
        for k in range(blocks):
            h = block_distances(k, start, stop)
            np.minimum(h, noise_clip, out=h)
            np.add(total, h, out=total, casting="unsafe")  # h <= noise_clip: the sum fits
        for i in range(start, stop):  # row i's pairs (i, j > i), in pdist order
            row = total[i - start, i + 1:]
            out[pos:pos + row.size] = row
            pos += row.size
    return out


def _xor_blocks(x: np.ndarray, block_bits: int):
    """Block ``k``'s Hamming distances of rows ``start:stop`` to every row, from each block read as an integer."""
    n = x.shape[0]
    word = np.uint32 if block_bits <= 32 else np.uint64
    weights = np.left_shift(word(1), np.arange(block_bits - 1, -1, -1, dtype=word))
    codes = (x.reshape(n, -1, block_bits).astype(word) * weights).sum(axis=2, dtype=word)
    codes = np.ascontiguousarray(codes.T)  # (blocks, n)

    def block(k: int, start: int, stop: int) -> np.ndarray:
        return np.bitwise_count(codes[k, start:stop, None] ^ codes[k, None, :])

    return block


def _matmul_blocks(x: np.ndarray, block_bits: int):
    """Block ``k``'s Hamming distances as ``|a| + |b| - 2 a.b`` (small integers, exact in float32)."""
    n = x.shape[0]
    ones = x.astype(np.float32)
    counts = ones.reshape(n, -1, block_bits).sum(axis=2)

    def block(k: int, start: int, stop: int) -> np.ndarray:
        blk = slice(k * block_bits, (k + 1) * block_bits)
        h = ones[start:stop, blk] @ ones[:, blk].T
        h *= -2.0
        h += counts[start:stop, k, None]
        h += counts[None, :, k]
        return h

    return block


def sketch_pdist(packed: np.ndarray, n_bits: int, block_bits: int | None = None,
                 noise_clip: int | None = None, *, device: str = "auto") -> np.ndarray:
    """The condensed distances of packed sketches: Hamming (compiled popcount), or block-clipped.

    Block-clipped when ``block_bits`` is given, at ``noise_clip`` or else at
    :func:`default_noise_clip` of the block. ``device``: one of
    :data:`~server_kit.clustering.on_device.DEVICES`; ``"auto"`` takes the GPU
    for :data:`~server_kit.clustering.on_device.AUTO_MIN_PDIST_ROWS` rows or
    more when torch sees one (same distances).
    """
    from . import on_device  # here: importing the package never loads torch

    target = on_device.choose_device(device, np.shape(packed)[0], on_device.AUTO_MIN_PDIST_ROWS)
    if target is not None:
        return _torch_pdist(packed, n_bits, block_bits, noise_clip, target)
    if block_bits is None:
        return _bits.hamming_pdist(packed, n_bits)
    return bits_pdist(_bits.unpack_bits(packed, n_bits), n_bits, block_bits, noise_clip, device="cpu")


def bits_pdist(bits: np.ndarray, n_bits: int, block_bits: int | None = None,
               noise_clip: int | None = None, *, device: str = "auto") -> np.ndarray:
    """:func:`sketch_pdist` of 0/1 rows: the clipped path takes them as they are, Hamming packs them first.

    On a torch device (``device`` as in :func:`sketch_pdist`) the rows travel packed.
    """
    from . import on_device  # here: importing the package never loads torch

    target = on_device.choose_device(device, np.shape(bits)[0], on_device.AUTO_MIN_PDIST_ROWS)
    if target is not None:  # the clipped path reads the row width, as block_clipped_pdist does
        x = np.asarray(bits)
        width = n_bits if block_bits is None else x.shape[1]
        return _torch_pdist(np.packbits(x, axis=1), width, block_bits, noise_clip, target)
    if block_bits is None:
        return _bits.hamming_pdist(np.packbits(bits, axis=1), n_bits)
    clip = default_noise_clip(int(block_bits)) if noise_clip is None else int(noise_clip)
    return block_clipped_pdist(bits, int(block_bits), clip)


def _torch_pdist(packed: np.ndarray, n_bits: int, block_bits: int | None, noise_clip: int | None,
                 target: Any) -> np.ndarray:
    """:func:`sketch_pdist` on the torch device ``target``."""
    from . import on_device

    if block_bits is None:
        return on_device.hamming_pdist_torch(packed, n_bits, target)
    clip = default_noise_clip(int(block_bits)) if noise_clip is None else int(noise_clip)
    return on_device.block_clipped_pdist_torch(packed, n_bits, int(block_bits), clip, target)
