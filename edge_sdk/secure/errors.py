"""The one error a peer of a secure-aggregation round can cause: :class:`SecureError`."""

from __future__ import annotations

__all__ = ["SecureError"]


class SecureError(ValueError):
    """A message, a parameter or a request of a secure-aggregation round that a peer got wrong.

    Parameters
    ----------
    reason : str
        Short machine-readable code, for example ``"length"``, ``"peer"``, ``"tag"``,
        ``"threshold"``, ``"both"`` or ``"range"``; callers count refusals by it.
    message : str
        What was wrong, for people.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
