"""The masks' pseudo-random generator: :func:`prg`, a seed to ``length`` integers mod ``2**m``.

The keystream of AES-256-CTR keyed by the 32-byte seed (counter block 0 first), read as
little-endian ``uint32``, each masked to its low ``m`` bits. Every seed keys one stream of one
round: ``b_u`` is fresh, ``s_uv`` is bound to the round's context.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["prg"]

_ZERO_IV = bytes(16)


def prg(seed: bytes, length: int, m: int) -> np.ndarray:
    """``length`` pseudo-random integers in ``[0, 2**m)`` from a 32-byte seed, as ``uint32``.

    Parameters
    ----------
    seed : bytes
        32 bytes: the AES-256 key.
    length : int
        How many integers.
    m : int
        Bits per integer, 8 to 32.
    """
    if not isinstance(seed, bytes) or len(seed) != 32:
        raise ValueError("a PRG seed is 32 bytes")
    if not 1 <= m <= 32:
        raise ValueError(f"m must be in [1, 32], got {m}")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(_ZERO_IV)).encryptor()
    stream = encryptor.update(bytes(4 * length)) + encryptor.finalize()
    out = np.frombuffer(stream, dtype="<u4").astype(np.uint32)  # a writable copy, native order
    if m < 32:
        out &= np.uint32((1 << m) - 1)
    return out
