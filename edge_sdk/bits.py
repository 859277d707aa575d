"""Randomised binary quantisation, bit packing and Hamming distances.

The public functions validate their inputs and hand the work to a kernel
backend: the compiled Cython module ``edge_sdk._bits`` when it is built, its
pure-numpy twin ``edge_sdk._bits_numpy`` otherwise (or when the environment
variable ``FEDSKETCH_PURE_NUMPY=1`` forces it). Both give identical bits.

Bit layout: the bits of a sketch are the rounded values of its class vectors
concatenated in class order, packed most significant bit first (like
``np.packbits``); the unused low bits of the last byte are zero.
"""

from __future__ import annotations

import logging
import os
import secrets
from types import ModuleType
from typing import Literal

import numpy as np

from . import _bits_numpy

__all__ = [
    "BACKEND",
    "available_backends",
    "fresh_seed",
    "hamming_cdist",
    "hamming_pdist",
    "pack_bits",
    "quantize_pack",
    "unpack_bits",
]

log = logging.getLogger(__name__)

BackendName = Literal["cython", "numpy"]

_BACKENDS: dict[str, ModuleType] = {"numpy": _bits_numpy}
try:
    from . import _bits as _bits_cython  # type: ignore[attr-defined]

    _BACKENDS["cython"] = _bits_cython
except ImportError:  # pragma: no cover - depends on the build
    _bits_cython = None

#: The backend in use: "cython" when the extension is built and not disabled.
BACKEND: str = (
    "cython"
    if "cython" in _BACKENDS and os.environ.get("FEDSKETCH_PURE_NUMPY", "") in ("", "0")
    else "numpy"
)


def available_backends() -> tuple[str, ...]:
    """Names of the kernel backends importable here."""
    return tuple(sorted(_BACKENDS))


def _kernel(backend: str | None) -> ModuleType:
    name = BACKEND if backend is None else backend
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend {name!r} is not available; available: {available_backends()}"
        ) from None


def fresh_seed() -> int:
    """A 64-bit seed from the operating system's random source."""
    return secrets.randbits(64)


def flip_threshold(flip_prob: float) -> int:
    """The 32-bit integer threshold ``floor(P * 2**32)`` for flip probability P."""
    p = float(flip_prob)
    if not (0.0 <= p <= 0.5):  # also rejects NaN
        raise ValueError(f"flip_prob must be in [0, 0.5], got {flip_prob!r}")
    return int(p * 4294967296.0)


def _check_seed(seed: int) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed}")
    return seed


def quantize_pack(
    vectors: np.ndarray,
    flip_prob: float,
    seed: int | None = None,
    *,
    backend: BackendName | None = None,
) -> np.ndarray:
    """Min-max normalise each vector, round, flip bits with probability P, pack.

    Parameters
    ----------
    vectors : ndarray of float32 or float64
        Shape ``(groups, dim)`` for one sketch (for example classes x latent)
        or ``(sketches, groups, dim)`` for a batch. Each ``dim``-long vector is
        normalised on its own; a constant vector becomes all zeros.
    flip_prob : float
        Probability P in [0, 0.5] of flipping each rounded bit.
    seed : int, optional
        64-bit seed of the counter-based generator; ``None`` draws one from
        the operating system. The same seed gives the same bits on every
        backend and machine.
    backend : {"cython", "numpy"}, optional
        Force a backend (tests); default is :data:`BACKEND`.

    Returns
    -------
    ndarray of uint8
        ``(ceil(groups * dim / 8),)`` for one sketch, or
        ``(sketches, ceil(groups * dim / 8))`` for a batch.
    """
    arr = np.asarray(vectors)
    if arr.dtype not in (np.float32, np.float64):
        raise ValueError(f"vectors must be float32 or float64, got dtype {arr.dtype}")
    if arr.ndim not in (2, 3):
        raise ValueError(
            f"vectors must have shape (groups, dim) or (sketches, groups, dim), got {arr.shape}"
        )
    if arr.shape[-1] == 0 or arr.shape[-2] == 0:
        raise ValueError(f"vectors must have at least one group and one dimension, got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError("vectors contain NaN or Inf; expected finite values")
    threshold = flip_threshold(flip_prob)
    seed = fresh_seed() if seed is None else _check_seed(seed)
    single = arr.ndim == 2
    batch = np.ascontiguousarray(arr[None] if single else arr)
    out = _kernel(backend).quantize_pack(batch, threshold, seed)
    return out[0] if single else out


def pack_bits(bits: np.ndarray) -> np.ndarray:
    """Pack 0/1 values along the last axis, most significant bit first."""
    b = np.asarray(bits)
    if b.size and (b.min() < 0 or b.max() > 1):
        raise ValueError("bits must hold only 0 and 1")
    return np.packbits(b.astype(np.uint8, copy=False), axis=-1)


def unpack_bits(packed: np.ndarray | bytes, n_bits: int) -> np.ndarray:
    """Unpack the first ``n_bits`` bits of each packed row into uint8 0/1 values."""
    p = np.frombuffer(packed, dtype=np.uint8) if isinstance(packed, (bytes, bytearray)) else packed
    p = np.asarray(p, dtype=np.uint8)
    need = (int(n_bits) + 7) // 8
    if p.shape[-1] != need:
        raise ValueError(f"{n_bits} bits need {need} bytes per row, got {p.shape[-1]}")
    return np.unpackbits(p, axis=-1, count=int(n_bits))


def _as_words(packed: np.ndarray, n_bits: int | None, what: str) -> np.ndarray:
    """Rows of packed bytes as zero-padded uint64 words, with bits past n_bits cleared."""
    p = np.asarray(packed)
    if p.dtype != np.uint8 or p.ndim != 2:
        raise ValueError(f"{what} must be a 2-D uint8 array of packed rows, got {p.dtype} {p.shape}")
    nbytes = p.shape[1]
    if nbytes == 0:
        raise ValueError(f"{what} rows are empty")
    if n_bits is not None:
        n_bits = int(n_bits)
        if (n_bits + 7) // 8 != nbytes:
            raise ValueError(
                f"{what}: {n_bits} bits need {(n_bits + 7) // 8} bytes per row, got {nbytes}"
            )
    n_words = (nbytes + 7) // 8
    buf = np.zeros((p.shape[0], n_words * 8), dtype=np.uint8)
    buf[:, :nbytes] = p
    if n_bits is not None and n_bits % 8:
        buf[:, nbytes - 1] &= np.uint8((0xFF << (8 - n_bits % 8)) & 0xFF)
    return buf.view(np.uint64)


def hamming_pdist(
    packed: np.ndarray, n_bits: int | None = None, *, backend: BackendName | None = None
) -> np.ndarray:
    """Condensed pairwise Hamming distances between packed rows.

    Same order as ``scipy.spatial.distance.pdist``; values are bit counts
    (``pdist(..., 'hamming') * n_bits``) as int32. ``n_bits``, when given,
    checks the row length and ignores padding bits.
    """
    return _kernel(backend).hamming_pdist(_as_words(packed, n_bits, "packed"))


def hamming_cdist(
    xa: np.ndarray,
    xb: np.ndarray,
    n_bits: int | None = None,
    *,
    backend: BackendName | None = None,
) -> np.ndarray:
    """Hamming distances (bit counts, int32) of every row of ``xa`` to every row of ``xb``."""
    a = _as_words(xa, n_bits, "xa")
    b = _as_words(xb, n_bits, "xb")
    la, lb = np.shape(xa)[1], np.shape(xb)[1]
    if la != lb:
        raise ValueError(f"xa and xb rows differ in length: {la} vs {lb} bytes")
    return _kernel(backend).hamming_cdist(a, b)
