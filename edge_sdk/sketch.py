"""Client sketches (the paper's Algorithm 1): encode, average per class, quantise, pack.

A :class:`Sketcher` turns a client's labelled data into a :class:`Sketch`: the
encoder's mean latent vector per class (a uniform [0, 1) vector for a class
the client does not hold, so every client sends the same length and the
server cannot tell which classes are missing), each vector min-max
normalised, rounded to bits, each bit flipped with probability P, and the
bits packed. With 10 classes and a 20-value latent that is 200 bits, 25 bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import bits as _bits

__all__ = ["Encoder", "Sketch", "Sketcher", "pairwise_hamming", "stack_sketches"]

log = logging.getLogger(__name__)

#: Domain-separation word for the absent-class noise generator.
_NOISE_STREAM = 0x6E6F6973


class Encoder(Protocol):
    """What a :class:`Sketcher` needs: a latent size and an ``encode`` method."""

    @property
    def latent_dim(self) -> int: ...

    def encode(self, x: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class Sketch:
    """The packed bits a client sends, with the shape needed to read them.

    ``bits`` holds ``ceil(n_bits / 8)`` bytes; class ``c``'s latent bits are
    bits ``c * latent_dim`` to ``(c + 1) * latent_dim - 1``, most significant
    bit first.
    """

    bits: bytes
    num_classes: int
    latent_dim: int
    flip_prob: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.bits, bytes):
            object.__setattr__(self, "bits", bytes(self.bits))
        if self.num_classes < 1 or self.latent_dim < 1:
            raise ValueError(
                f"num_classes and latent_dim must be positive, got {self.num_classes} and {self.latent_dim}"
            )
        need = (self.n_bits + 7) // 8
        if len(self.bits) != need:
            raise ValueError(
                f"a sketch of {self.num_classes} classes x {self.latent_dim} bits needs "
                f"{need} bytes, got {len(self.bits)}"
            )
        tail = self.n_bits % 8
        if tail and self.bits[-1] & ((1 << (8 - tail)) - 1):
            raise ValueError("sketch padding bits past n_bits must be zero")

    @property
    def n_bits(self) -> int:
        """Number of meaningful bits (classes x latent)."""
        return self.num_classes * self.latent_dim

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for the bits."""
        return len(self.bits)

    def packed(self) -> np.ndarray:
        """The bits as a read-only uint8 array."""
        return np.frombuffer(self.bits, dtype=np.uint8)

    def unpack(self) -> np.ndarray:
        """The ``n_bits`` bits as uint8 0/1 values."""
        return _bits.unpack_bits(self.bits, self.n_bits)

    def class_bits(self) -> np.ndarray:
        """The bits as a ``(num_classes, latent_dim)`` uint8 array."""
        return self.unpack().reshape(self.num_classes, self.latent_dim)

    def hamming(self, other: Sketch) -> int:
        """Number of differing bits with another sketch of the same shape."""
        _check_same_shape([self, other])
        return int(_bits.hamming_cdist(self.packed()[None], other.packed()[None], self.n_bits)[0, 0])

    def hex(self) -> str:
        """The bytes in hexadecimal (for logs and printing)."""
        return self.bits.hex()


def _check_same_shape(sketches: Sequence[Sketch]) -> None:
    shapes = {(s.num_classes, s.latent_dim) for s in sketches}
    if len(shapes) > 1:
        raise ValueError(f"sketches differ in shape (classes, latent): {sorted(shapes)}")


def stack_sketches(sketches: Iterable[Sketch]) -> np.ndarray:
    """Packed rows ``(n, nbytes)`` of sketches that share one shape."""
    items = list(sketches)
    if not items:
        raise ValueError("no sketches to stack")
    _check_same_shape(items)
    return np.stack([s.packed() for s in items])


def pairwise_hamming(sketches: Sequence[Sketch]) -> np.ndarray:
    """Square matrix of Hamming distances (bit counts) between sketches."""
    rows = stack_sketches(sketches)
    return _bits.hamming_cdist(rows, rows, sketches[0].n_bits)


class Sketcher:
    """Builds a client's sketch from its data (Algorithm 1 of Prigent et al.).

    Parameters
    ----------
    encoder : Encoder
        Usually an :class:`edge_sdk.OnnxEncoder`; anything with ``latent_dim``
        and ``encode(x) -> (n, latent_dim)``.
    num_classes : int
        Number of classes of the federation (every client sends them all).
    flip_prob : float
        Probability P in [0, 0.5] of flipping each bit (the paper uses 0.1).
    seed : int, optional
        Seed of the flips and of the absent-class noise. ``None`` draws one
        from the operating system once, when the Sketcher is made: sketching
        the same data twice then gives the same bits, so a server that asks
        again learns nothing new by averaging repeated sketches.
    """

    def __init__(
        self, encoder: Encoder, num_classes: int, flip_prob: float = 0.1, seed: int | None = None
    ) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        _bits.flip_threshold(flip_prob)  # validates P
        latent = int(encoder.latent_dim)
        if latent < 1:
            raise ValueError(f"encoder latent_dim must be positive, got {latent}")
        self.encoder = encoder
        self.num_classes = int(num_classes)
        self.flip_prob = float(flip_prob)
        self.latent_dim = latent
        self._seed = _bits.fresh_seed() if seed is None else _bits._check_seed(seed)

    @property
    def n_bits(self) -> int:
        """Bits per sketch."""
        return self.num_classes * self.latent_dim

    def _check_labels(self, y: Any, n: int) -> np.ndarray:
        lab = np.asarray(y)
        if lab.ndim != 1 or lab.shape[0] != n:
            raise ValueError(f"y must be a 1-D array of {n} labels (one per sample), got shape {lab.shape}")
        if lab.size == 0:
            raise ValueError("no samples: a sketch needs at least one labelled sample")
        if not np.issubdtype(lab.dtype, np.integer):
            raise ValueError(f"labels must be integers, got dtype {lab.dtype}")
        lo, hi = int(lab.min()), int(lab.max())
        if lo < 0 or hi >= self.num_classes:
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}), got values from {lo} to {hi}"
            )
        return lab.astype(np.intp, copy=False)

    def class_means(self, x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
        """Per-class mean encodings and the mask of classes present.

        Returns ``(vectors, present)``: ``vectors`` is float64
        ``(num_classes, latent_dim)`` with a uniform [0, 1) vector for every
        absent class; ``present`` is a boolean ``(num_classes,)`` mask. The
        mask stays on the device: it is not part of the sketch.
        """
        n = len(x) if hasattr(x, "__len__") else np.asarray(x).shape[0]
        lab = self._check_labels(y, n)
        z = np.asarray(self.encoder.encode(x), dtype=np.float64)
        if z.shape != (n, self.latent_dim):
            raise ValueError(
                f"encoder returned shape {z.shape}, expected ({n}, {self.latent_dim})"
            )
        if not np.isfinite(z).all():
            raise ValueError("encoder returned NaN or Inf; check the model and its input")
        counts = np.bincount(lab, minlength=self.num_classes)
        sums = np.zeros((self.num_classes, self.latent_dim), dtype=np.float64)
        np.add.at(sums, lab, z)
        present = counts > 0
        vectors = np.empty_like(sums)
        vectors[present] = sums[present] / counts[present, None]
        n_absent = int((~present).sum())
        if n_absent:
            rng = np.random.default_rng([self._seed, _NOISE_STREAM])
            vectors[~present] = rng.random((n_absent, self.latent_dim))
        log.debug(
            "class means: %d samples, %d of %d classes present", n, int(present.sum()), self.num_classes
        )
        return vectors, present

    def sketch(self, x: Any, y: Any) -> Sketch:
        """The client's sketch of samples ``x`` with integer labels ``y``."""
        vectors, _ = self.class_means(x, y)
        return self.sketch_vectors(vectors)

    def sketch_vectors(self, vectors: np.ndarray) -> Sketch:
        """Quantise and pack ready ``(num_classes, latent_dim)`` class vectors."""
        v = np.asarray(vectors)
        if v.shape != (self.num_classes, self.latent_dim):
            raise ValueError(
                f"class vectors have shape {v.shape}, expected ({self.num_classes}, {self.latent_dim})"
            )
        packed = _bits.quantize_pack(v, self.flip_prob, self._seed)
        return Sketch(packed.tobytes(), self.num_classes, self.latent_dim, self.flip_prob)

    def __repr__(self) -> str:
        return (
            f"Sketcher(encoder={self.encoder!r}, num_classes={self.num_classes}, "
            f"flip_prob={self.flip_prob}, n_bits={self.n_bits})"
        )
