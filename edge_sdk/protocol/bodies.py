"""Message bodies: a sketch's packed bits, and named tensors as safetensors.

A SKETCH body is ``u16 num_classes, u16 latent_dim`` and the packed bits; a
10-class x 20-bit sketch is 29 bytes (4 of shape, 25 of bits). Tensors
(updates, models, features) travel as safetensors, never pickle, and are
checked against the names, shapes and dtypes the receiver expects.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np

from ..sketch import Sketch
from .envelope import ProtocolError

__all__ = ["check_features", "check_tensors", "parse_sketch", "parse_tensors", "sketch_body", "tensors_body"]

_SKETCH_SHAPE = struct.Struct(">HH")


# -- sketch bodies ----------------------------------------------------------


def sketch_body(sketch: Sketch) -> bytes:
    """Body of a SKETCH message: u16 num_classes, u16 latent_dim, packed bits."""
    if not (0 < sketch.num_classes <= 0xFFFF and 0 < sketch.latent_dim <= 0xFFFF):
        raise ValueError(
            f"sketch shape ({sketch.num_classes}, {sketch.latent_dim}) does not fit in two u16 fields"
        )
    return _SKETCH_SHAPE.pack(sketch.num_classes, sketch.latent_dim) + sketch.bits


def parse_sketch(body: bytes, *, num_classes: int | None = None, latent_dim: int | None = None) -> Sketch:
    """Read a SKETCH body back into a :class:`~edge_sdk.sketch.Sketch`.

    Parameters
    ----------
    body : bytes
        The message body.
    num_classes, latent_dim : int, optional
        The shape the server expects; a sketch of another shape is refused.

    Raises
    ------
    ProtocolError
        Reason ``sketch-length``: short body, wrong shape, wrong number of
        bytes, or padding bits set.
    """
    if len(body) < _SKETCH_SHAPE.size:
        raise ProtocolError("sketch-length", f"sketch body of {len(body)} bytes lacks its 4-byte shape")
    nc, ld = _SKETCH_SHAPE.unpack_from(body)
    if (num_classes is not None and nc != num_classes) or (latent_dim is not None and ld != latent_dim):
        raise ProtocolError(
            "sketch-length",
            f"sketch shape ({nc} classes, {ld} bits) differs from the expected "
            f"({num_classes} classes, {latent_dim} bits)",
        )
    try:
        return Sketch(bytes(body[_SKETCH_SHAPE.size :]), nc, ld)
    except ValueError as e:
        raise ProtocolError("sketch-length", f"invalid sketch body: {e}") from None


# -- tensor bodies ----------------------------------------------------------


def tensors_body(tensors: Mapping[str, np.ndarray]) -> bytes:
    """Serialise named arrays with safetensors (never pickle)."""
    from safetensors.numpy import save

    if not tensors:
        raise ValueError("no tensors to serialise")
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        arr = np.asarray(value)
        # (np.ascontiguousarray would turn a 0-d array into shape (1,))
        arrays[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")
    return save(arrays)


def _check_spec(spec: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    out = {}
    for name, entry in spec.items():
        try:
            shape, dtype = entry
            out[name] = (tuple(int(d) for d in shape), np.dtype(dtype))
        except (TypeError, ValueError) as e:
            raise ValueError(f"spec entry {name!r} must be (shape, dtype name), got {entry!r}: {e}") from None
    return out


def parse_tensors(
    body: bytes, *, spec: Mapping[str, tuple[tuple[int, ...], str]] | None = None
) -> dict[str, np.ndarray]:
    """Read a safetensors body, checking it against what the receiver expects.

    Parameters
    ----------
    body : bytes
        The message body.
    spec : mapping of name to (shape, dtype), optional
        The exact tensor names, shapes and dtypes (``"float32"``...) the
        receiver expects. Without it only the format and finiteness are checked.

    Returns
    -------
    dict of str to ndarray
        Writable arrays, in the order of the payload.

    Raises
    ------
    ProtocolError
        Reasons: ``tensors`` (not safetensors), ``tensor-name``,
        ``tensor-shape``, ``tensor-dtype``, ``non-finite``.
    """
    from safetensors.numpy import load

    try:
        arrays = load(bytes(body))
    except Exception as e:  # safetensors raises its own error types (and TypeError on odd dtypes)
        raise ProtocolError("tensors", f"body is not valid safetensors data: {e}") from None
    return check_tensors(arrays, spec=spec)


def check_tensors(
    arrays: Mapping[str, np.ndarray], *, spec: Mapping[str, tuple[tuple[int, ...], str]] | None = None
) -> dict[str, np.ndarray]:
    """Check named arrays a peer sent against what the receiver expects; writable copies.

    The checks of :func:`parse_tensors`, for tensors that arrived in another
    container (a Flower ``ArrayRecord``, :mod:`edge_sdk.flower`).

    Raises
    ------
    ProtocolError
        Reasons: ``tensor-name``, ``tensor-shape``, ``tensor-dtype``, ``non-finite``.
    """
    expected = None if spec is None else _check_spec(spec)
    if expected is not None and set(arrays) != set(expected):
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        raise ProtocolError("tensor-name", f"tensor names differ from the spec: missing {missing}, unexpected {extra}")
    out = {}
    for name, arr in arrays.items():
        if expected is not None:
            shape, dtype = expected[name]
            if arr.shape != shape:
                raise ProtocolError("tensor-shape", f"tensor {name!r} has shape {arr.shape}, expected {shape}")
            if arr.dtype != dtype:
                raise ProtocolError("tensor-dtype", f"tensor {name!r} has dtype {arr.dtype}, expected {dtype}")
        if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
            raise ProtocolError("non-finite", f"tensor {name!r} contains NaN or Inf")
        out[name] = np.array(arr, copy=True)
    return out


def check_features(arrays: Mapping[str, np.ndarray], shape: tuple[int | None, ...] | None = None) -> np.ndarray:
    """A float summary (LADD's spectra): exactly one float32 2-D tensor ``features``, of ``shape`` if given.

    A ``None`` in ``shape`` takes any size (``(num_classes, None)``: the first summary fixes the width).

    Raises
    ------
    ProtocolError
        Reasons ``tensor-name`` and ``tensor-shape``.
    """
    feats = arrays.get("features")
    if set(arrays) != {"features"} or feats is None or feats.dtype != np.float32 or feats.ndim != 2:
        raise ProtocolError("tensor-name", "a features message holds one float32 2-D tensor 'features'")
    if shape is not None and any(want is not None and got != want for got, want in zip(feats.shape, shape)):
        raise ProtocolError("tensor-shape", f"features of shape {feats.shape}, expected {tuple(shape)}")
    return feats
