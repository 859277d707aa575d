"""The bytes of a round's messages before they exist: :func:`round_sizes` and one function per message.

With ids of ``k`` UTF-8 bytes each, ``n`` peers, ``s`` survivors, ``d = n - s`` dropped, ``length``
entries of ``m`` bits::

    masked update   8 + k + ceil(length m / 8) + n (k + 96)      device -> server
    unmask request  7 + n (k + 1) + s (k + 96)                   server -> each survivor
    reveal          6 + k + s (k + 67) + d (k + 33)              survivor -> server
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .messages import SEALED_SHARE_BYTES, SEED_BYTES
from .packing import packed_size
from .params import SecureParams
from .shamir import SHARE_BYTES

__all__ = ["RoundSizes", "masked_update_size", "reveal_size", "round_sizes", "unmask_request_size"]


def _id(device: str) -> int:
    return 1 + len(device.encode("utf-8"))


def _split(params: SecureParams, survivors: Iterable[str] | None) -> tuple[list[str], list[str]]:
    alive = set(params.ids if survivors is None else survivors)
    return [d for d in params.ids if d in alive], [d for d in params.ids if d not in alive]


def masked_update_size(params: SecureParams, sender: str) -> int:
    """The bytes of ``sender``'s :class:`.MaskedUpdate`."""
    sealed = sum(_id(d) + 1 + SEALED_SHARE_BYTES for d in params.ids)
    return 1 + _id(sender) + 4 + packed_size(params.length, params.modulus_bits) + 2 + sealed


def unmask_request_size(params: SecureParams, survivors: Iterable[str] | None = None) -> int:
    """The bytes of one :class:`.UnmaskRequest` when ``survivors`` (default: everyone) survived."""
    alive, _ = _split(params, survivors)
    return 7 + sum(map(_id, params.ids)) + sum(_id(d) + 1 + SEALED_SHARE_BYTES for d in alive)


def reveal_size(params: SecureParams, sender: str, survivors: Iterable[str] | None = None) -> int:
    """The bytes of ``sender``'s :class:`.Reveal` when ``survivors`` (default: everyone) survived."""
    alive, gone = _split(params, survivors)
    return (5 + _id(sender) + sum(_id(d) + SHARE_BYTES for d in alive)
            + sum(_id(d) + SEED_BYTES for d in gone))


@dataclass(frozen=True)
class RoundSizes:
    """One device's bytes in one round: ``up`` (masked update and reveal) and ``down`` (its request)."""

    masked_update: int
    unmask_request: int
    reveal: int

    @property
    def up(self) -> int:
        """The bytes the device sends."""
        return self.masked_update + self.reveal

    @property
    def down(self) -> int:
        """The bytes the device receives."""
        return self.unmask_request


def round_sizes(params: SecureParams, device: str, survivors: Iterable[str] | None = None) -> RoundSizes:
    """The bytes of ``device``'s three messages in a round where ``survivors`` (default: everyone) survived."""
    alive = None if survivors is None else list(survivors)
    return RoundSizes(masked_update_size(params, device), unmask_request_size(params, alive),
                      reveal_size(params, device, alive))
