"""Golomb-Rice coding of the sparse bodies' index gaps (Sattler et al.'s STC codes its positions this way).

With parameter ``b``, a gap ``g`` is its quotient ``g >> b`` in unary (that many 1 bits, then a 0)
and its remainder ``g & (2**b - 1)`` in ``b`` bits. The block holds the unary parts of all ``k``
gaps, then their ``k`` remainders, least significant bit first, padded with 0 bits to a whole
byte: ``ceil((sum(g >> b) + k + k b) / 8)`` bytes. For gaps around 100 (1 % kept) that is about
8.5 bits a position, where LEB128 takes 8 or 16. :func:`best_parameter` picks the ``b`` that gives
the fewest bytes; the encoder of :mod:`.codec` keeps LEB128 when it is as small.

:func:`read_rice` trusts nothing: the block's size is checked against the most ``k`` gaps within
``n`` entries can need before a bit is unpacked, and a block that holds fewer than ``k`` unary
parts, ends before its remainders, or has set padding bits or a needless byte is refused
(``compressed-index``).
"""

from __future__ import annotations

import numpy as np

from ..protocol import ProtocolError

__all__ = ["best_parameter", "max_rice_bytes", "read_rice", "rice", "rice_bytes"]

#: The largest parameter (gaps are below 2**32).
MAX_B = 31


def rice_bytes(gaps: np.ndarray, b: int) -> int:
    """The bytes of :func:`rice`'s block for ``gaps`` with parameter ``b``."""
    k = len(gaps)
    return -(-(int(np.sum(gaps >> np.uint64(b))) + k + k * b) // 8)


def best_parameter(gaps: np.ndarray) -> tuple[int, int]:
    """The ``b`` of fewest bytes for ``gaps`` (uint64), and those bytes."""
    sizes = [rice_bytes(gaps, b) for b in range(MAX_B + 1)]
    b = int(np.argmin(sizes))
    return b, sizes[b]


def rice(gaps: np.ndarray, b: int) -> np.ndarray:
    """The Rice block (uint8) of ``gaps`` (uint64 below 2**32) with parameter ``b``."""
    k = len(gaps)
    q = (gaps >> np.uint64(b)).astype(np.int64)
    unary = np.ones(int(q.sum()) + k, dtype=np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0  # each quotient's terminating 0
    rem = ((gaps[:, None] >> np.arange(b, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8).reshape(-1)
    return np.packbits(np.concatenate([unary, rem]), bitorder="little")


def max_rice_bytes(n: int, k: int, b: int) -> int:
    """The most bytes a valid block of ``k`` increasing indices below ``n`` takes with parameter ``b``."""
    return -(-((max(n - 1, 0) >> b) + k + k * b) // 8)


def read_rice(block: np.ndarray, k: int, b: int, where: str) -> np.ndarray:
    """The ``k`` gaps (uint64) of a Rice block whose size the caller checked against :func:`max_rice_bytes`."""
    bits = np.unpackbits(block, bitorder="little")
    zeros = np.flatnonzero(bits == 0)
    if len(zeros) < k:
        raise ProtocolError("compressed-index", f"{where}: the Rice block holds fewer than {k} quotients")
    ends = zeros[:k]
    start = int(ends[-1]) + 1 if k else 0
    used = start + k * b
    if used > len(bits):
        raise ProtocolError("compressed-index", f"{where}: the Rice block ends inside its remainders")
    if -(-used // 8) != len(block) or bits[used:].any():
        raise ProtocolError("compressed-index", f"{where}: the Rice block has set padding bits or a needless byte")
    q = np.diff(ends, prepend=-1).astype(np.uint64) - np.uint64(1)
    rem = bits[start:used].reshape(k, b).astype(np.uint64) << np.arange(b, dtype=np.uint64)
    return (q << np.uint64(b)) | rem.sum(axis=1, dtype=np.uint64)
