"""LEB128 varints of the sparse bodies' index gaps, vectorised (no loop per entry)."""

from __future__ import annotations

import numpy as np

from ..protocol import ProtocolError

__all__ = ["read_varints", "varints"]

_MAX_U32 = 0xFFFFFFFF


def varints(values: np.ndarray) -> np.ndarray:
    """LEB128 bytes of unsigned integers below 2**32 (uint8 array), without a loop per entry."""
    v = values.astype(np.uint64, copy=False)
    nb = np.ones(len(v), dtype=np.int64)
    for bits in (7, 14, 21, 28):
        nb += v >= (1 << bits)
    ends = np.cumsum(nb)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    starts = ends - nb
    for j in range(5):
        sel = nb > j
        if j and not sel.any():
            break
        chunk = (v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        out[starts[sel] + j] = chunk.astype(np.uint8) | ((nb[sel] > j + 1).astype(np.uint8) << 7)
    return out


def read_varints(block: np.ndarray, k: int, where: str) -> np.ndarray:
    """Decode exactly ``k`` varints that fill ``block``; uint64 values below 2**32."""
    ends = np.flatnonzero(block < 0x80)
    if len(ends) != k:
        raise ProtocolError("compressed-index", f"{where}: the index block holds {len(ends)} varints, "
                                                f"k is {k}")
    if len(block) and ends[-1] != len(block) - 1:
        raise ProtocolError("compressed-index", f"{where}: the index block ends inside a varint")
    if k == len(block):  # every gap in one byte
        return block.astype(np.uint64)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 5:
        raise ProtocolError("compressed-index", f"{where}: a varint of {int(lengths.max())} bytes (at most 5)")
    if ((lengths > 1) & (block[ends] == 0)).any():
        raise ProtocolError("compressed-index", f"{where}: a varint ends with a needless zero byte")
    values = (block[starts] & 0x7F).astype(np.uint64)
    for j in range(1, 5):
        sel = lengths > j
        if not sel.any():
            break
        values[sel] |= (block[starts[sel] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    if values.max() > _MAX_U32:
        raise ProtocolError("compressed-index", f"{where}: a varint of {int(values.max())} (at most 2**32 - 1)")
    return values


