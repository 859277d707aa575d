"""Who belongs to a seeded sample of devices: one rule, the same on the server and on every device.

The final evaluation can ask a fraction of the fleet in one broadcast
command (``fraction``, ``seed``); each device decides by itself whether it is
in the sample, and the server knows whom to wait for, because both call
:func:`in_sample`. It hashes the seed and the device id with SHA-256 (the
standard library's, so the answer is the same on every machine, Python
version and architecture) and keeps the device when the hash, read as a
number in [0, 1), falls below ``fraction``.
"""

from __future__ import annotations

import hashlib

__all__ = ["in_sample", "sample_point"]

_SCALE = float(2**53)


def sample_point(cid: str, seed: int) -> float:
    """The device's deterministic point in [0, 1) for ``seed``.

    Parameters
    ----------
    cid : str
        The device id.
    seed : int
        The sample's seed.

    Returns
    -------
    float
        The top 53 bits of the first 8 bytes of ``sha256(f"{seed}:{cid}")``
        (big-endian) over 2**53: exact in a float, and below 1.
    """
    digest = hashlib.sha256(f"{int(seed)}:{cid}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / _SCALE


def in_sample(cid: str, fraction: float, seed: int) -> bool:
    """Whether device ``cid`` is in the sample of ``fraction`` of the fleet drawn with ``seed``.

    Parameters
    ----------
    cid : str
        The device id.
    fraction : float
        Share of the devices sampled, in [0, 1]; 1 keeps every device, 0 none.
    seed : int
        The sample's seed: the same seed gives the same sample everywhere.

    Returns
    -------
    bool
        ``sample_point(cid, seed) < fraction``.

    Raises
    ------
    ValueError
        When ``fraction`` is not a number in [0, 1].
    """
    f = float(fraction)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    return f >= 1.0 or sample_point(cid, seed) < f
