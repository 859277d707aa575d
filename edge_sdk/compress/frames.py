"""A compressed body's tensors as their raw parts, for a decoder that runs elsewhere (the server's GPU).

:func:`frame_delta` reads an ``int8`` or ``int4`` body (:mod:`.codec`) with
every check of :func:`~.codec.decode_delta` (header, method, counts, lengths,
scales, the body's exact end) but those of each entry's code (``int8``: -128;
``int4``: a nibble 0, a padding nibble not 0), and gives each tensor's scales
and codes as views of the body, without building a float array. Whoever
decodes the codes checks their values: ``server_kit.coded_sum`` does so on the
device and refuses the update with the same reason (``compressed-value``).

:func:`coded_change` is what a server's intake keeps when it decodes an
update only where it sums it (``server_kit.rounds.decoding``): the frames with
every check of ``decode_delta`` (the codes' values too) and the norm of the
change they stand for, computed from the codes without decoding them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocol import ProtocolError
from .blocks import BLOCK, check_nibbles, frame_int4, int4_values
from .codec import Method, check_int8, frame_int8, int8_values, open_body

__all__ = ["FRAMED_METHODS", "CodedChange", "Frame", "applied", "coded_change", "frame_delta", "frame_values"]

#: The methods whose bodies :func:`frame_delta` reads.
FRAMED_METHODS: frozenset[Method] = frozenset({Method.INT8, Method.INT4})


@dataclass(frozen=True)
class Frame:
    """One tensor of a body, as sent."""

    name: str
    shape: tuple[int, ...]
    #: float32: ``int8`` one scale; ``int4`` one per block of 256 entries.
    scales: np.ndarray
    #: ``int8``: the ``n`` entries (int8); ``int4``: ``ceil(n / 2)`` bytes of nibbles ``q + 8``, the low first.
    codes: np.ndarray

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def frame_delta(body: bytes, spec: Mapping[str, tuple[tuple[int, ...], str]], method: Method) -> list[Frame]:
    """The tensors of ``body`` (sorted names), checked as :func:`~.codec.decode_delta` checks all but code values.

    Raises
    ------
    ProtocolError
        As :func:`~.codec.decode_delta` would, but for the codes' values.
    ValueError
        A method other than ``int8`` or ``int4``, or a bad spec.
    """
    method = Method(method)
    if method not in FRAMED_METHODS:
        raise ValueError(f"frame_delta reads int8 and int4 bodies, not {method.value}")
    r, shapes = open_body(body, spec, method)
    read = frame_int8 if method is Method.INT8 else frame_int4
    frames = [Frame(name, shape, *read(r, f"tensor {name!r}", math.prod(shape))) for name, shape in shapes.items()]
    if r.pos != len(r.body):
        raise ProtocolError("compressed-length", f"{len(r.body) - r.pos} trailing bytes after the last tensor")
    return frames


def frame_values(frame: Frame, method: Method) -> np.ndarray:
    """What ``frame`` comes back as, on the host (float32, shaped), its codes checked: :func:`~.codec.decode_delta`'s
    arithmetic, bit for bit (a decoder elsewhere takes its small tensors, a model's integer counters, here)."""
    where = f"tensor {frame.name!r}"
    if Method(method) is Method.INT8:
        values = int8_values(frame.scales, frame.codes, where)
    else:
        values = int4_values(frame.scales, frame.codes, frame.size, where)
    return values.reshape(frame.shape)


@dataclass(frozen=True)
class CodedChange:
    """A compressed update's change as it came (its frames, codes checked), for a sum that decodes it itself.

    ``norm`` is the L2 norm of the change the codes stand for, over the
    floating tensors, computed from the codes (:func:`coded_change`): the
    exact ``q * scale`` in float64, where decoding rounds each value to
    float32 (a relative difference of about 1e-7). ``base`` is the model the
    update started from, set when the round screens it; ``factor`` scales
    the decoded change before it is added to ``base`` (a clipped update:
    ``base + float32(change * float32(factor))``).
    """

    frames: tuple[Frame, ...]
    method: Method
    norm: float
    base: Mapping[str, np.ndarray] | None = None
    factor: float = 1.0

    def on(self, base: Mapping[str, np.ndarray]) -> CodedChange:
        """This change, applied to ``base``."""
        return dataclasses.replace(self, base=base)

    def scaled(self, factor: float) -> CodedChange:
        """This change scaled by ``factor`` (on top of any earlier factor)."""
        return dataclasses.replace(self, factor=self.factor * float(factor))

    def weights(self) -> dict[str, np.ndarray]:
        """The update's whole weights, decoded on the host (``base`` must be set)."""
        if self.base is None:
            raise ValueError("a coded change has no base until the round screens it")
        return {f.name: applied(self.base[f.name], f, self.method, self.factor) for f in self.frames}


def applied(base: np.ndarray, frame: Frame, method: Method, factor: float = 1.0) -> np.ndarray:
    """``base`` plus ``frame``'s decoded change, on the host: a floating tensor's change times ``factor`` first
    (``float32(change * float32(factor))``), an integer counter's unscaled (clipping leaves counters alone)."""
    from .codec import add_change

    change = frame_values(frame, method)
    if factor != 1.0 and np.asarray(base).dtype.kind == "f":
        change = np.multiply(change, np.float32(factor), dtype=np.float32)
    return add_change(base, change)


#: Each byte of int4 nibbles: the sum of its two codes' squares, ``(lo - 8)**2 + (hi - 8)**2``.
_NIBBLE_SQUARES = np.array([((b & 0x0F) - 8) ** 2 + ((b >> 4) - 8) ** 2 for b in range(256)], dtype=np.int32)


def coded_change(body: bytes, spec: Mapping[str, tuple[tuple[int, ...], Any]], method: Method) -> CodedChange:
    """``body`` framed and checked as :func:`~.codec.decode_delta` checks it, its codes' values included,
    and the norm of its floating tensors' change computed from the codes, without decoding them.

    Raises
    ------
    ProtocolError
        As :func:`~.codec.decode_delta` would for the same body.
    """
    method = Method(method)
    frames = frame_delta(body, spec, method)
    total = 0.0
    for f in frames:
        where = f"tensor {f.name!r}"
        squares = _int8_squares(f, where) if method is Method.INT8 else _int4_squares(f, where)
        if np.dtype(spec[f.name][1]).kind == "f":
            total += float(np.dot(f.scales.astype(np.float64) ** 2, squares))
    return CodedChange(tuple(frames), method, math.sqrt(total))


def _int8_squares(f: Frame, where: str) -> np.ndarray:
    """The sum of an int8 tensor's squared entries (one scale), the entries checked."""
    q = f.codes
    check_int8(q, where)
    return np.array([float(np.dot(q.astype(np.int64), q.astype(np.int64)))])


def _int4_squares(f: Frame, where: str) -> np.ndarray:
    """Per block of 256 entries, the sum of an int4 tensor's squared codes, the nibbles checked."""
    packed, n = f.codes, f.size
    check_nibbles(packed & 0x0F, packed >> 4, n, where)
    per_byte = _NIBBLE_SQUARES[packed]
    if n % 2:
        per_byte[-1] -= 64  # the padding nibble 0 counts (0 - 8)**2 in the table
    starts = np.arange(0, packed.size, BLOCK // 2)
    return np.add.reduceat(per_byte, starts).astype(np.float64) if packed.size else np.zeros(0)
