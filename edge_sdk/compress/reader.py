"""Reading a compressed body from a peer: every field read only after the bytes left are checked."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from ..protocol import ProtocolError

__all__ = ["Reader", "read_scalar"]

_F32 = struct.Struct("<f")


class Reader:
    """A position in a body; every read checks the bytes left first."""

    def __init__(self, body: bytes) -> None:
        self.body, self.pos = body, 0
        #: The body's format version (its header's; a method's layout may depend on it).
        self.version = 1

    def need(self, size: int, what: str) -> int:
        """The position, after checking that ``size`` bytes are left for ``what``."""
        left = len(self.body) - self.pos
        if size > left:
            raise ProtocolError("compressed-length", f"{what} needs {size} bytes, {left} left")
        return self.pos

    def unpack(self, fmt: struct.Struct, what: str) -> tuple[Any, ...]:
        self.pos = self.need(fmt.size, what) + fmt.size
        return fmt.unpack_from(self.body, self.pos - fmt.size)

    def array(self, dtype: str, count: int, what: str) -> np.ndarray:
        start = self.need(np.dtype(dtype).itemsize * count, what)
        out = np.frombuffer(self.body, dtype=dtype, count=count, offset=start)
        self.pos = start + out.nbytes
        return out


def read_scalar(r: Reader, what: str) -> np.float32:
    (value,) = r.unpack(_F32, what)
    if not math.isfinite(value) or math.copysign(1.0, value) < 0:
        raise ProtocolError("compressed-value", f"{what} is {value!r}; it must be finite and >= 0")
    return np.float32(value)
