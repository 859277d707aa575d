"""The round's three messages and their bytes: :class:`MaskedUpdate`, :class:`UnmaskRequest`, :class:`Reveal`.

Integers are big-endian; a device id is one length byte then its UTF-8 bytes (``id``); a sealed
share is the 12-byte AES-GCM nonce, the 66-byte encrypted share and the 16-byte tag (94 bytes)::

    MaskedUpdate   u8 1, id sender, u32 len(y), y (ceil(length m / 8) bytes),
                   u16 n, n x (id to, u8 94, sealed share)
    UnmaskRequest  u8 2, u16 count, count x id survivor, u16 count, count x id dropped,
                   u16 count, count x (id from, u8 94, sealed share)
    Reveal         u8 3, id sender, u16 count, count x (id survivor, 66-byte share of its b),
                   u16 count, count x (id dropped, 32-byte pair seed)

``from_bytes(data, params)`` reads them strictly (a truncated message, trailing bytes, an unknown,
empty or repeated id, a wrong length: :class:`.SecureError`), then checks them as
``check(params)`` does for a message built in memory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import SecureError
from .packing import packed_size
from .params import SecureParams, encode_id
from .shamir import SHARE_BYTES, share_from_bytes
from .wire import Reader

__all__ = ["NONCE_BYTES", "SEALED_SHARE_BYTES", "SEED_BYTES", "TAG_BYTES", "MaskedUpdate", "Reveal",
           "UnmaskRequest"]

NONCE_BYTES = 12
TAG_BYTES = 16
#: A share of a self-mask seed, encrypted for one peer: nonce, share, tag.
SEALED_SHARE_BYTES = NONCE_BYTES + SHARE_BYTES + TAG_BYTES
#: A pair's mask seed.
SEED_BYTES = 32
_MASKED, _REQUEST, _REVEAL = 1, 2, 3


def _sealed(what: str, device: str, share: object) -> None:
    size = len(share) if isinstance(share, bytes) else None
    if size != SEALED_SHARE_BYTES:
        raise SecureError("length", f"{what}: the share for {device!r} holds {size} bytes, expected "
                                    f"{SEALED_SHARE_BYTES} (nonce 12, share 66, tag 16)")


def _known(what: str, devices, params: SecureParams) -> None:
    seen: set[str] = set()
    for d in devices:
        if not params.knows(d):
            raise SecureError("peer", f"{what}: {d!r} is not a peer of this round")
        if d in seen:
            raise SecureError("peer", f"{what}: {d!r} appears twice")
        seen.add(d)


def _id_size(device: str) -> int:
    return 1 + len(device.encode("utf-8"))


def _sealed_size(shares: dict[str, bytes]) -> int:
    return 2 + sum(_id_size(d) + 1 + len(s) for d, s in shares.items())


def _ids(devices) -> bytes:
    return struct.pack(">H", len(devices)) + b"".join(encode_id(d) for d in devices)


def _read_sealed(r: Reader, field: str) -> dict[str, bytes]:
    count, out = r.u16(f"the count of {field}"), {}
    for _ in range(count):
        device = r.once(r.device(f"an id of {field}"), out, field)
        size = r.u8(f"the length of the share for {device!r}")
        if size != SEALED_SHARE_BYTES:
            raise r.fail("length", f"the share for {device!r} holds {size} bytes, expected "
                                   f"{SEALED_SHARE_BYTES} (nonce 12, share 66, tag 16)")
        out[device] = r.take(size, f"the share for {device!r}")
    return out


def _write_sealed(shares: dict[str, bytes]) -> bytes:
    return struct.pack(">H", len(shares)) + b"".join(
        encode_id(d) + bytes([len(s)]) + s for d, s in shares.items())


@dataclass(frozen=True)
class MaskedUpdate:
    """Device ``sender``'s masked update ``y`` (packed, ``m`` bits an entry) and its sealed shares of ``b``.

    ``shares`` maps every peer of the round (the sender too) to the share of the sender's self-mask
    seed addressed to it, sealed with their pair's AES-GCM key.
    """

    sender: str
    y: bytes
    shares: dict[str, bytes]

    def check(self, params: SecureParams) -> MaskedUpdate:
        """This message, refused unless it fits the round (:class:`.SecureError`)."""
        what = "masked update"
        _known(what, [self.sender], params)
        expected = packed_size(params.length, params.modulus_bits)
        size = len(self.y) if isinstance(self.y, bytes) else None
        if size != expected:
            raise SecureError("length", f"{what}: y holds {size} bytes, expected {expected} for "
                                        f"{params.length} entries of {params.modulus_bits} bits")
        spare = 8 * expected - params.length * params.modulus_bits
        if spare and self.y[-1] >> (8 - spare):
            raise SecureError("padding", f"{what}: the {spare} unused bits of y's last byte are not zero")
        _known(what, self.shares, params)
        missing = [d for d in params.ids if d not in self.shares]
        if missing:
            raise SecureError("peer", f"{what}: no share for {', '.join(map(repr, missing))}")
        for device, share in self.shares.items():
            _sealed(what, device, share)
        return self

    @property
    def wire_size(self) -> int:
        """The bytes of :meth:`to_bytes`, counted without building them."""
        return 1 + _id_size(self.sender) + 4 + len(self.y) + _sealed_size(self.shares)

    def to_bytes(self) -> bytes:
        """The message's bytes."""
        return (bytes([_MASKED]) + encode_id(self.sender) + struct.pack(">I", len(self.y)) + self.y
                + _write_sealed(self.shares))

    @classmethod
    def from_bytes(cls, data: bytes, params: SecureParams) -> MaskedUpdate:
        """The message of ``data``, read strictly and checked against the round."""
        r = Reader(data, "masked update", params)
        r.kind(_MASKED)
        sender = r.device("the sender")
        size = r.u32("the length of y")
        expected = packed_size(params.length, params.modulus_bits)
        if size != expected:
            raise r.fail("length", f"y holds {size} bytes, expected {expected} for {params.length} entries "
                                   f"of {params.modulus_bits} bits")
        y = r.take(size, "y")
        shares = _read_sealed(r, "the shares")
        r.end()
        return cls(sender, y, shares).check(params)


@dataclass(frozen=True)
class UnmaskRequest:
    """The server's request to one survivor ``w``: who survived, who dropped, and the shares addressed to ``w``.

    ``shares_for_you`` maps each survivor ``v`` to the sealed share of ``b_v`` that ``v`` addressed
    to ``w`` in its masked update.
    """

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    shares_for_you: dict[str, bytes]

    def check(self, params: SecureParams) -> UnmaskRequest:
        """This message, refused unless every name is a peer, none twice in a list, every share 94 bytes."""
        what = "unmask request"
        _known(what, self.survivors, params)
        _known(what, self.dropped, params)
        _known(what, self.shares_for_you, params)
        for device, share in self.shares_for_you.items():
            _sealed(what, device, share)
        return self

    @property
    def wire_size(self) -> int:
        """The bytes of :meth:`to_bytes`, counted without building them."""
        return 5 + sum(map(_id_size, self.survivors + self.dropped)) + _sealed_size(self.shares_for_you)

    def to_bytes(self) -> bytes:
        """The message's bytes."""
        return bytes([_REQUEST]) + _ids(self.survivors) + _ids(self.dropped) + _write_sealed(self.shares_for_you)

    @classmethod
    def from_bytes(cls, data: bytes, params: SecureParams) -> UnmaskRequest:
        """The message of ``data``, read strictly and checked against the round."""
        r = Reader(data, "unmask request", params)
        r.kind(_REQUEST)
        survivors = r.devices("the survivors")
        dropped = r.devices("the dropped")
        shares = _read_sealed(r, "the shares")
        r.end()
        return cls(survivors, dropped, shares).check(params)


@dataclass(frozen=True)
class Reveal:
    """Survivor ``sender``'s answer: its shares of the survivors' ``b`` and its pair seeds with the dropped.

    ``b_shares`` maps each survivor to its 66-byte share (plain); ``pair_seeds`` maps each dropped
    device ``v`` to the 32-byte ``s_wv`` of this round. No device is in both.
    """

    sender: str
    b_shares: dict[str, bytes]
    pair_seeds: dict[str, bytes]

    def check(self, params: SecureParams) -> Reveal:
        """This message, refused unless its names are peers, its shares and seeds well formed, none in both."""
        what = "reveal"
        _known(what, [self.sender], params)
        _known(what, self.b_shares, params)
        _known(what, self.pair_seeds, params)
        both = [d for d in self.b_shares if d in self.pair_seeds]
        if both:
            raise SecureError("both", f"{what}: both a share and a pair seed of {both[0]!r}")
        for device, share in self.b_shares.items():
            try:
                share_from_bytes(share)
            except SecureError as e:
                raise SecureError(e.reason, f"{what}: the share of {device!r}: {e}") from None
        for device, seed in self.pair_seeds.items():
            if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
                raise SecureError("length", f"{what}: the pair seed with {device!r} is not {SEED_BYTES} bytes")
        return self

    @property
    def wire_size(self) -> int:
        """The bytes of :meth:`to_bytes`, counted without building them."""
        return (5 + _id_size(self.sender) + sum(_id_size(d) + SHARE_BYTES for d in self.b_shares)
                + sum(_id_size(d) + SEED_BYTES for d in self.pair_seeds))

    def to_bytes(self) -> bytes:
        """The message's bytes."""
        shares = b"".join(encode_id(d) + s for d, s in self.b_shares.items())
        seeds = b"".join(encode_id(d) + s for d, s in self.pair_seeds.items())
        return (bytes([_REVEAL]) + encode_id(self.sender) + struct.pack(">H", len(self.b_shares)) + shares
                + struct.pack(">H", len(self.pair_seeds)) + seeds)

    @classmethod
    def from_bytes(cls, data: bytes, params: SecureParams) -> Reveal:
        """The message of ``data``, read strictly and checked against the round."""
        r = Reader(data, "reveal", params)
        r.kind(_REVEAL)
        sender = r.device("the sender")
        parts: list[dict[str, bytes]] = []
        for field, one, size in (("the shares", "the share", SHARE_BYTES),
                                 ("the pair seeds", "the pair seed", SEED_BYTES)):
            count, out = r.u16(f"the count of {field}"), {}
            for _ in range(count):
                device = r.once(r.device(f"an id of {field}"), out, field)
                out[device] = r.take(size, f"{one} of {device!r}")
            parts.append(out)
        r.end()
        return cls(sender, parts[0], parts[1]).check(params)
