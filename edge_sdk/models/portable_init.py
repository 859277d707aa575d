"""Seeded initial weights that every platform builds bit for bit, without torch.

A federation's model version 0 is ``initial_tensors(spec, seed)``: each device builds it itself, on
x86 as on a Raspberry Pi (aarch64), so the server never sends it. torch's and numpy's generators
promise no identity across platforms; this module's generator has exact steps instead.

The generator is SplitMix64 (Steele, Lea and Flood, 2014), run as a counter: the seed (below 2**64)
is mixed once, ``seed_mix = mix(seed * G)``, and the ``i``-th draw (from 0) of stream ``s`` is::

    x = seed_mix + (s << 32) + i + 1          (mod 2**64)
    z = mix(x * G)                             (mod 2**64)
    u = (z >> 40) * 2**-24                     (float32, in [0, 1))

with ``G = 0x9E3779B97F4A7C15`` and SplitMix64's finaliser ``mix``: ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``. That is SplitMix64 seeded with state
``(seed_mix + (s << 32)) * G``; every step is a wrapping uint64 operation, exact everywhere, and the
top 24 bits times ``2**-24`` is exact in float32.

Each tensor follows torch's default initialisation in law (not in value); its stream is its index
in the spec, so no tensor depends on another's size:

- a float ``*.weight`` of 2 or more dimensions: uniform in ``[-b, b]``, ``b = 1 / sqrt(fan_in)``,
  ``fan_in = prod(shape[1:])`` (torch's ``kaiming_uniform_(a=sqrt(5))`` of Linear and Conv, and
  ConvTranspose's, whose dimension 1 is its fan-in);
- its sibling ``*.bias``: uniform in ``[-b, b]`` with the same ``b``;
- a float ``*.weight`` of one dimension (BatchNorm, LayerNorm): ones; its ``*.bias``: zeros;
- ``*running_mean``: zeros; ``*running_var``: ones; integer tensors (``num_batches_tracked``): zeros;
- anything else: ValueError.

A value is ``u * (2 b) - b`` in float32, with ``b`` computed in float64 (``math.sqrt``) and rounded
to float32 once: each float32 operation is correctly rounded, so the bits are the same everywhere.
:func:`tensors_sha256` hashes tensors without depending on the safetensors library's version.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["initial_tensors", "portable_uniform", "tensors_sha256"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MAX_STREAM = 1 << 32


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array, in place (wrapping arithmetic); returns ``z``."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 1 << 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def portable_uniform(seed: int, stream: int, n: int) -> np.ndarray:
    """``n`` float32 draws in ``[0, 1)`` of stream ``stream`` under ``seed``, the same bits everywhere.

    Parameters
    ----------
    seed : int
        In ``[0, 2**64)``.
    stream : int
        In ``[0, 2**32)``; streams of one seed do not overlap for ``n < 2**32``.
    n : int
        How many draws, in ``[0, 2**32)``.

    Returns
    -------
    numpy.ndarray
        float32, multiples of ``2**-24``.
    """
    seed = _check_seed(seed)
    for value, what in ((stream, "stream"), (n, "n")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < _MAX_STREAM:
            raise ValueError(f"{what} must be an integer in [0, 2**32), got {value!r}")
    seed_mix = int(_mix(np.array([seed], dtype=np.uint64) * _GOLDEN)[0])
    base = (seed_mix + (int(stream) << 32) + 1) % (1 << 64)
    z = np.arange(int(n), dtype=np.uint64)
    z += np.uint64(base)
    z *= _GOLDEN
    top = _mix(z) >> np.uint64(40)
    return top.astype(np.float32) * np.float32(2.0**-24)


def _bound(shape: tuple[int, ...]) -> np.float32:
    """``1 / sqrt(fan_in)`` in float64, rounded to float32 once (0 for an empty fan-in)."""
    fan_in = math.prod(shape[1:])
    return np.float32(1.0 / math.sqrt(fan_in)) if fan_in else np.float32(0.0)


def _uniform(seed: int, stream: int, shape: tuple[int, ...], b: np.float32) -> np.ndarray:
    u = portable_uniform(seed, stream, math.prod(shape))
    u *= np.float32(b + b)
    u -= b
    return u.reshape(shape)


def _check_spec(spec: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    if not isinstance(spec, Mapping):
        raise ValueError(f"spec must be a mapping of name to (shape, dtype), got {type(spec).__name__}")
    out = {}
    for name, entry in spec.items():
        try:
            shape, dtype = entry
            out[str(name)] = (tuple(int(d) for d in shape), np.dtype(dtype))
        except (TypeError, ValueError) as e:
            raise ValueError(f"spec entry {name!r} must be (shape, dtype), got {entry!r}: {e}") from None
    return out


def _weight_ndim(name: str, stem: str, spec: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> int:
    """The number of dimensions of ``stem + "weight"``, the sibling of a bias (ValueError when none)."""
    sibling = spec.get(stem + "weight")
    if sibling is None or not np.issubdtype(sibling[1], np.floating):
        raise ValueError(f"no portable initialisation rule for tensor {name!r}: no float sibling "
                         f"{stem + 'weight'!r} in the spec")
    return len(sibling[0])


def _tensor(name: str, stream: int, seed: int,
            spec: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> np.ndarray:
    """One tensor of :func:`initial_tensors` (its own stream)."""
    shape, dtype = spec[name]
    if np.issubdtype(dtype, np.integer):
        return np.zeros(shape, dtype=dtype)
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(f"no portable initialisation rule for tensor {name!r} of dtype {dtype.name}")
    leaf = name.rpartition(".")[2]
    stem = name[: len(name) - len(leaf)]
    if leaf == "weight" and len(shape) >= 2:
        out = _uniform(seed, stream, shape, _bound(shape))
    elif leaf == "weight" and len(shape) == 1:
        out = np.ones(shape, dtype=np.float32)
    elif leaf == "bias" and _weight_ndim(name, stem, spec) >= 2:
        out = _uniform(seed, stream, shape, _bound(spec[stem + "weight"][0]))
    elif leaf == "bias" and len(spec[stem + "weight"][0]) == 1:
        out = np.zeros(shape, dtype=np.float32)
    elif name.endswith("running_mean"):
        out = np.zeros(shape, dtype=np.float32)
    elif name.endswith("running_var"):
        out = np.ones(shape, dtype=np.float32)
    else:
        raise ValueError(f"no portable initialisation rule for tensor {name!r} of shape {shape}")
    return out if dtype == np.float32 else out.astype(dtype)


def initial_tensors(spec: Mapping[str, tuple[tuple[int, ...], Any]], seed: int) -> dict[str, np.ndarray]:
    """Seeded initial tensors of a model, bit for bit the same on every platform.

    Parameters
    ----------
    spec : mapping of str to (shape, dtype)
        Names, shapes and dtypes in the order of the model's ``state_dict`` (the order gives each
        tensor's stream), for example :func:`edge_sdk.models.model_checks.state_spec` of it.
    seed : int
        In ``[0, 2**64)``.

    Returns
    -------
    dict of str to numpy.ndarray
        New arrays of the spec's shapes and dtypes, in its order; the rules are in this module's
        docstring.

    Raises
    ------
    ValueError
        A bad seed or spec, or a tensor no rule covers (named in the message).
    """
    seed = _check_seed(seed)
    checked = _check_spec(spec)
    return {name: _tensor(name, i, seed, checked) for i, name in enumerate(checked)}


def tensors_sha256(weights: Mapping[str, Any]) -> str:
    """A sha256 of named tensors that depends on no file format's version.

    Per name in sorted order: the name in UTF-8, a zero byte, the dtype's name (``float32``) in
    ASCII, a zero byte, the number of dimensions and each dimension as little-endian u64, then the
    entries' little-endian bytes in C order.

    Parameters
    ----------
    weights : mapping of str to array-like
        Named tensors.

    Returns
    -------
    str
        The hex digest.
    """
    h = hashlib.sha256()
    for name in sorted(weights):
        a = np.asarray(weights[name])
        h.update(str(name).encode("utf-8") + b"\0" + a.dtype.name.encode("ascii") + b"\0")
        h.update(np.array([a.ndim, *a.shape], dtype="<u8").tobytes())
        h.update(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
    return h.hexdigest()
