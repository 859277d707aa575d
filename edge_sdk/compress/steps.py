"""Models downstream as a chain of compressed changes.

A device that holds model version ``v`` needs the changes ``v -> v + 1 -> ... -> latest``, not the
whole model. Each change is a :class:`Step` whose body is :func:`~.codec.encode_delta`'s body of
that change, and the steps travel as one chain body, little-endian::

    offset  size  field
    0       2     magic b"FC"
    2       1     version (1)
    3       1     method (1 = int8, 2 = topk, 3 = stc, 4 = sign, 5 = int4), the one of every step body
    4       4     u32 count of steps, 1 to max_steps
    then per step:
            4     u32 base: the model version the step applies to
            4     u32 version: base + 1
            4     u32 length of the body
            len   the step's body (a compressed delta, :mod:`.codec`)

The steps are consecutive (each base is the previous step's version) and the chain ends exactly
after the last; a chain has at least one step. :func:`apply_steps` adds each decoded change to the
held tensors with ``np.add`` in float32 (:func:`~.codec.add_change`; integer counters rounded); the
sender builds each version the same way (it can call :func:`apply_steps` itself) so that both sides
hold the same bits.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..protocol import ProtocolError
from ..validation import check_choice, check_int
from .codec import _CODES, Method, add_change, decode_delta

__all__ = ["Step", "apply_steps", "chain_body", "parse_chain"]

MAGIC = b"FC"
VERSION = 1
_HEADER = struct.Struct("<2sBBI")
_STEP = struct.Struct("<III")
_MAX_U32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Step:
    """One change of a model: from version ``base`` to ``version = base + 1``.

    Parameters
    ----------
    base : int
        The model version it applies to, in ``[0, 2**32 - 1)``.
    version : int
        ``base + 1``.
    body : bytes
        ``encode_delta(change, comp)[0]``.
    """

    base: int
    version: int
    body: bytes

    def __post_init__(self) -> None:
        base = check_int(self.base, "step base", 0)
        if base >= _MAX_U32:
            raise ValueError(f"step base must be below 2**32 - 1, got {base}")
        if self.version != base + 1:
            raise ValueError(f"step version must be base + 1 = {base + 1}, got {self.version!r}")
        if not isinstance(self.body, (bytes, bytearray, memoryview)):
            raise ValueError(f"step body must be bytes, got {type(self.body).__name__}")
        object.__setattr__(self, "body", bytes(self.body))


def _check_consecutive(steps: Sequence[Step]) -> list[Step]:
    steps = list(steps)
    for step in steps:
        if not isinstance(step, Step):
            raise ValueError(f"steps must be Step objects, got {type(step).__name__}")
    for prev, step in zip(steps, steps[1:]):
        if step.base != prev.version:
            raise ValueError(f"steps are not consecutive: version {prev.version}, "
                             f"then a step from {step.base}")
    return steps


def chain_body(steps: Sequence[Step]) -> bytes:
    """The chain body of consecutive steps (format in this module's docstring).

    Raises
    ------
    ValueError
        No steps, steps that are not consecutive, a body that is not a compressed delta, bodies
        of different methods, a body of 4 GiB or more.
    """
    steps = _check_consecutive(steps)
    if not steps:
        raise ValueError("a chain needs at least one step")
    methods = set()
    for step in steps:
        if len(step.body) < 8 or step.body[:2] != b"FZ" or step.body[3] not in _CODES.values():
            raise ValueError(f"step {step.base} -> {step.version}: the body is not a compressed delta")
        if len(step.body) > _MAX_U32:
            raise ValueError(f"step {step.base} -> {step.version}: "
                             f"a body of {len(step.body)} bytes (under 4 GiB)")
        methods.add(step.body[3])
    if len(methods) != 1:
        raise ValueError(f"the step bodies mix methods {sorted(methods)}; a chain has one")
    parts = [_HEADER.pack(MAGIC, VERSION, methods.pop(), len(steps))]
    for step in steps:
        parts += [_STEP.pack(step.base, step.version, len(step.body)), step.body]
    return b"".join(parts)


def parse_chain(body: bytes, method: Method, max_steps: int = 64) -> list[Step]:
    """Read a chain body from a peer; the step bodies themselves are checked when applied.

    Parameters
    ----------
    body : bytes
        The chain body.
    method : Method
        The method the receiver expects (not ``none``).
    max_steps : int
        The most steps accepted.

    Returns
    -------
    list of Step

    Raises
    ------
    ProtocolError
        ``compressed-header`` (short, bad magic or version), ``compressed-method``,
        ``compressed-count`` (no steps or more than ``max_steps``), ``compressed-length`` (a
        field or body past the end, trailing bytes), ``compressed-index`` (a version that is not
        base + 1, steps not consecutive).
    """
    code = _CODES[Method(check_choice(method, "method", [m.value for m in _CODES]))]
    max_steps = check_int(max_steps, "max_steps", 1)
    body = bytes(body)
    if len(body) < _HEADER.size:
        raise ProtocolError("compressed-header",
                            f"chain of {len(body)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, got, count = _HEADER.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError("compressed-header", f"not a chain of changes (magic {magic!r}, version {version})")
    if got != code:
        raise ProtocolError("compressed-method",
                            f"chain method byte {got}, expected {code} ({Method(method).value})")
    if not 1 <= count <= max_steps:
        raise ProtocolError("compressed-count", f"chain of {count} steps (1 to {max_steps})")
    pos = _HEADER.size
    if count * _STEP.size > len(body) - pos:
        raise ProtocolError("compressed-length",
                            f"{count} steps need {count * _STEP.size} bytes, {len(body) - pos} left")
    steps: list[Step] = []
    for i in range(count):
        if _STEP.size > len(body) - pos:
            raise ProtocolError("compressed-length", f"step {i}: its header runs past the end")
        base, version, length = _STEP.unpack_from(body, pos)
        pos += _STEP.size
        if length > len(body) - pos:
            raise ProtocolError("compressed-length", f"step {i}: a body of {length} bytes, {len(body) - pos} left")
        if version != base + 1 or (steps and base != steps[-1].version):
            after = f" after version {steps[-1].version}" if steps else ""
            raise ProtocolError("compressed-index", f"step {i}: {base} -> {version}{after} (not consecutive)")
        steps.append(Step(base, version, body[pos : pos + length]))
        pos += length
    if pos != len(body):
        raise ProtocolError("compressed-length", f"{len(body) - pos} trailing bytes after the last step")
    return steps


def apply_steps(held_version: int, weights: Mapping[str, np.ndarray], steps: Sequence[Step],
                method: Method) -> tuple[int, dict[str, np.ndarray]]:
    """Bring held weights up to the last step's version.

    Steps up to the held version are skipped (already held); from the step whose base is the held
    version onward, each change is decoded against ``weights``' names and shapes and added with
    :func:`~.codec.add_change` (``np.add`` in float32; integer counters rounded, kept integer).

    Parameters
    ----------
    held_version : int
        The version of ``weights``.
    weights : mapping of str to ndarray
        The held tensors, floating point (taken as float32) or integer counters; never modified.
    steps : sequence of Step
        Consecutive steps (:func:`parse_chain`'s result).
    method : Method
        The method of the step bodies.

    Returns
    -------
    version : int
        The version now held: the last step's, or ``held_version`` when every step was held.
    weights : dict of str to ndarray
        New float32 arrays (integer counters keep their dtype).

    Raises
    ------
    ValueError
        ``"model version v held; the changes start at b"`` when the held version is before the
        first step; steps not consecutive; weights that are not floating point.
    ProtocolError
        A step body :func:`~.codec.decode_delta` refuses (nothing is applied then).
    """
    held = check_int(held_version, "held_version", 0)
    steps = _check_consecutive(steps)
    if steps and held < steps[0].base:
        raise ValueError(f"model version {held} held; the changes start at {steps[0].base}")
    current = {}
    for name, value in weights.items():
        arr = np.asarray(value)
        if np.issubdtype(arr.dtype, np.integer):  # a counter (BatchNorm's num_batches_tracked): kept integer
            current[name] = arr
        elif np.issubdtype(arr.dtype, np.floating):
            current[name] = arr.astype(np.float32, copy=False)
        else:
            raise ValueError(f"held tensor {name!r} has dtype {arr.dtype}; the weights are floating point or "
                             "integer counters")
    spec = {name: (arr.shape, "float32") for name, arr in current.items()}
    version = held
    for step in steps:
        if step.base < version:
            continue
        change = decode_delta(step.body, spec, method)
        current = {name: add_change(current[name], change[name], out=change[name]) for name in spec}
        version = step.version
    if version == held:
        current = {name: arr.copy() for name, arr in current.items()}
    return version, current
