"""Shamir's secret sharing of 32-byte secrets over the prime field of ``p = 2**521 - 1``.

A secret ``s < 2**256`` is the constant term of a random polynomial ``f`` of degree ``t - 1``; the
share of the peer at place ``i`` (0-based) of the round's peers is ``f(i + 1)``. Any ``t`` shares give
``s = f(0)`` by Lagrange interpolation; ``t - 1`` shares tell nothing of it. A share travels as 66
bytes, big-endian.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from .errors import SecureError

__all__ = ["PRIME", "SECRET_BYTES", "SHARE_BYTES", "lagrange_at", "reconstruct", "share_from_bytes",
           "share_to_bytes", "split"]

#: The field's prime, a Mersenne prime.
PRIME = 2 ** 521 - 1
#: The bytes of a share (521 bits, big-endian).
SHARE_BYTES = 66
#: The bytes of a secret.
SECRET_BYTES = 32


def split(secret: bytes, n: int, t: int, random_bytes: Callable[[int], bytes] = os.urandom) -> list[int]:
    """The ``n`` shares of ``secret`` (32 bytes) with threshold ``t``: ``f(1), ..., f(n)``.

    Parameters
    ----------
    secret : bytes
        32 bytes, read big-endian.
    n, t : int
        ``2 <= t <= n``.
    random_bytes : callable
        ``random_bytes(k)`` gives ``k`` random bytes (:func:`os.urandom`; a seeded one for tests).
    """
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes")
    if not 2 <= t <= n:
        raise ValueError(f"need 2 <= t <= n, got t={t}, n={n}")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [int.from_bytes(random_bytes(SHARE_BYTES), "big") % PRIME for _ in range(t - 1)]
    shares = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares.append(y)
    return shares


def share_to_bytes(share: int) -> bytes:
    """A share as 66 bytes, big-endian."""
    return share.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    """A share from its 66 bytes.

    Raises
    ------
    SecureError
        ``"length"``: not 66 bytes; ``"range"``: not below ``p``.
    """
    if not isinstance(data, bytes):
        raise SecureError("length", f"a share is {SHARE_BYTES} bytes, got a {type(data).__name__}")
    if len(data) != SHARE_BYTES:
        raise SecureError("length", f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise SecureError("range", "a share is not below the prime 2**521 - 1")
    return value


def lagrange_at(points: Mapping[int, int], x: int) -> int:
    """The value at ``x`` of the polynomial of degree ``len(points) - 1`` through ``points`` (``{x_i: y_i}``)."""
    total = 0
    for xi, yi in points.items():
        num, den = 1, 1
        for xj in points:
            if xj != xi:
                num = num * (x - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total


def reconstruct(points: Mapping[int, int], t: int) -> bytes:
    """The secret of at least ``t`` shares ``{x: f(x)}``, every share beyond the first ``t`` checked.

    Raises
    ------
    SecureError
        ``"threshold"``: fewer than ``t`` shares; ``"range"``: an ``x`` outside ``[1, p)`` or a share
        not below ``p``; ``"share"``: the shares do not lie on one polynomial of degree ``t - 1``
        (some peer lied) or the secret is not below ``2**256``.
    """
    if len(points) < t:
        raise SecureError("threshold", f"{len(points)} shares, {t} needed")
    for x, y in points.items():
        if not 1 <= x < PRIME or not 0 <= y < PRIME:
            raise SecureError("range", f"share at x={x} is out of the field")
    xs = sorted(points)
    base = {x: points[x] for x in xs[:t]}
    for x in xs[t:]:
        if lagrange_at(base, x) != points[x]:
            raise SecureError("share", f"the share at x={x} does not lie on the polynomial of the first {t}")
    secret = lagrange_at(base, 0)
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise SecureError("share", f"the shares give a secret of more than {SECRET_BYTES} bytes")
    return secret.to_bytes(SECRET_BYTES, "big")
