"""A float update as small integers for secure aggregation: :class:`SecureQuantizer`, :func:`modulus_bits_for`.

Every device of a round quantises with the same clip, bits and rotation seed, so that the server's
sum of integers decodes to the mean of the (clipped) updates:

1. the update is scaled down to L2 norm ``clip`` if it is longer (:meth:`SecureQuantizer.clip_vector`);
2. padded with zeros to a multiple of 16 and rotated: random signs (bit ``i`` of SHAKE-128 of the
   seed, least significant first, 1 = negate), then an orthonormal Walsh-Hadamard transform per
   block (as many blocks of 4,096 as fit, then 1,024, 256, 64 and 16: :func:`.compress.rotated.blocks_of`);
3. each rotated entry divided by its block's step ``4 clip / sqrt(b) / 2**(bits-1)`` and rounded
   stochastically (up with the probability of its fraction: unbiased), clamped to
   ``[-2**(bits-1), 2**(bits-1) - 1]``. A block holding all of a norm-``clip`` vector has entries of
   standard deviation ``clip / sqrt(b)`` once rotated: the clamp is at 4 of them.

:meth:`SecureQuantizer.decode` undoes 3 and 2 on the sum and divides by the count: the mean.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from ..compress.rotated import _hadamard, blocks_of, padded

__all__ = ["SecureQuantizer", "modulus_bits_for"]


def modulus_bits_for(bits: int, devices: int) -> int:
    """The modulus bits that hold the sum of ``devices`` integers of ``bits`` bits: ``bits + ceil(log2 devices)``, >= 8.

    Raises
    ------
    ValueError
        ``bits`` or ``devices`` below 1, or more than 32 bits needed.
    """
    if bits < 1 or devices < 1:
        raise ValueError(f"bits and devices must be >= 1, got {bits} and {devices}")
    m = max(8, bits + (devices - 1).bit_length())
    if m > 32:
        raise ValueError(f"{devices} sums of {bits}-bit integers need {m} bits, more than 32")
    return m


@dataclass(frozen=True)
class SecureQuantizer:
    """The integers of a float update, and the mean of a sum of them, for one round.

    Parameters
    ----------
    clip : float
        The largest L2 norm of an update; longer ones are scaled down to it.
    bits : int
        Bits per integer, 2 to 31 (the modulus must also hold the sum: :func:`modulus_bits_for`).
    seed_rotation : bytes
        The rotation's seed, the same on every device of the round (and new each round).
    """

    clip: float
    bits: int
    seed_rotation: bytes

    def __post_init__(self) -> None:
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) \
                or not math.isfinite(self.clip) or self.clip <= 0:
            raise ValueError(f"clip must be a finite number > 0, got {self.clip!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 31:
            raise ValueError(f"bits must be an integer in [2, 31], got {self.bits!r}")
        if not isinstance(self.seed_rotation, bytes):
            raise ValueError("seed_rotation must be bytes")

    @staticmethod
    def length(n: int) -> int:
        """The integers of an update of ``n`` entries: ``n`` rounded up to a multiple of 16."""
        return padded(n)

    def clip_vector(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        """``x`` (float64) scaled to L2 norm ``clip`` if it is longer, and whether it was."""
        v = np.asarray(x, dtype=np.float64).reshape(-1)
        if not np.isfinite(v).all():
            raise ValueError("the update holds NaN or Inf")
        norm = float(np.linalg.norm(v))
        if norm > self.clip:
            return v * (self.clip / norm), True
        return v.copy(), False

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, bool]:
        """The ``int64`` integers of a flat update (``length(x.size)`` of them) and whether it was clipped."""
        v, clipped = self.clip_vector(x)
        y = np.zeros(padded(v.size), dtype=np.float64)
        y[:v.size] = v
        self._rotate(y)
        y /= self._steps(y.size)
        q = np.floor(y + rng.random(y.size))
        top = 2 ** (self.bits - 1)
        return np.clip(q, -top, top - 1).astype(np.int64), clipped

    def decode(self, sum_ints: np.ndarray, count: int, n: int) -> np.ndarray:
        """The mean of ``count`` updates of ``n`` entries (float32) from the sum of their integers."""
        s = np.asarray(sum_ints)
        if s.shape != (padded(n),) or not np.issubdtype(s.dtype, np.integer):
            raise ValueError(f"sum_ints must be {padded(n)} integers, got {s.dtype} of shape {s.shape}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        y = s.astype(np.float64) * self._steps(s.size) / count
        self._unrotate(y)
        return y[:n].astype(np.float32)

    def _steps(self, m: int) -> np.ndarray:
        """Each padded entry's step: ``4 clip / sqrt(b) / 2**(bits-1)`` for its block of ``b``."""
        steps = np.empty(m, dtype=np.float64)
        for start, b, count in blocks_of(m):
            steps[start:start + b * count] = 4 * self.clip / math.sqrt(b) / 2 ** (self.bits - 1)
        return steps

    def _signs(self, m: int) -> np.ndarray:
        raw = np.frombuffer(hashlib.shake_128(self.seed_rotation).digest(m // 8), dtype=np.uint8)
        return np.unpackbits(raw, bitorder="little").view(bool)

    @staticmethod
    def _transform(y: np.ndarray) -> None:
        """The orthonormal Walsh-Hadamard transform of each block of ``y``, in place (its own inverse)."""
        for start, b, count in blocks_of(y.size):
            rows = y[start:start + b * count].reshape(count, b)
            _hadamard(rows)
            rows /= math.sqrt(b)

    def _rotate(self, y: np.ndarray) -> None:
        np.negative(y, out=y, where=self._signs(y.size))
        self._transform(y)

    def _unrotate(self, y: np.ndarray) -> None:
        self._transform(y)
        np.negative(y, out=y, where=self._signs(y.size))
