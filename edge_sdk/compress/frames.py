"""A compressed body's tensors as their raw parts, for a decoder that runs elsewhere (the server's GPU).

:func:`frame_delta` reads an ``int8`` or ``int4`` body (:mod:`.codec`) with
every check of :func:`~.codec.decode_delta` (header, method, counts, lengths,
scales, the body's exact end) but those of each entry's code (``int8``: -128;
``int4``: a nibble 0, a padding nibble not 0), and gives each tensor's scales
and codes as views of the body, without building a float array. Whoever
decodes the codes checks their values: ``server_kit.coded_sum`` does so on the
device and refuses the update with the same reason (``compressed-value``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..protocol import ProtocolError
from .blocks import frame_int4, int4_values
from .codec import Method, frame_int8, int8_values, open_body

__all__ = ["FRAMED_METHODS", "Frame", "frame_delta", "frame_values"]

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
