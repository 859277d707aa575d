"""A round's parameters: :class:`SecureParams`, :func:`round_context`, :func:`default_threshold`."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import SecureError

__all__ = ["KEY_BYTES", "MAX_ID_BYTES", "SecureParams", "default_threshold", "encode_id", "params_from_command",
           "round_context"]

#: The bytes of an X25519 public key.
KEY_BYTES = 32
#: The longest device id, in UTF-8 bytes (its length travels in one byte).
MAX_ID_BYTES = 255
_MAX_PEERS = 65535


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def encode_id(device: str) -> bytes:
    """A device id on the wire: one length byte, then its UTF-8 bytes (1 to 255 of them).

    Raises
    ------
    SecureError
        ``"peer"``: not a string, empty, or longer than 255 bytes.
    """
    raw = device.encode("utf-8") if isinstance(device, str) else b""
    if not 1 <= len(raw) <= MAX_ID_BYTES:
        raise SecureError("peer", f"a device id must be 1 to {MAX_ID_BYTES} UTF-8 bytes, got {device!r}")
    return bytes([len(raw)]) + raw


def round_context(run_id: str, round_: int, model: str) -> bytes:
    """The bytes that name one round of one model of one run; every key of the round is bound to them.

    ``u16 len, run id (UTF-8), u64 round, u16 len, model (UTF-8)``, big-endian: no two different
    triples give the same bytes.
    """
    if not isinstance(run_id, str) or not isinstance(model, str):
        raise TypeError(f"run_id and model must be strings, got {run_id!r} and {model!r}")
    if not _is_int(round_) or not 0 <= round_ < 2 ** 64:
        raise ValueError(f"round_ must be an integer in [0, 2**64), got {round_!r}")
    run, name = run_id.encode("utf-8"), model.encode("utf-8")
    if len(run) > 0xFFFF or len(name) > 0xFFFF:
        raise ValueError("run_id and model must be at most 65,535 UTF-8 bytes each")
    return struct.pack(">H", len(run)) + run + struct.pack(">Q", round_) + struct.pack(">H", len(name)) + name


def default_threshold(n: int) -> int:
    """The default threshold of ``n`` devices: a strict majority, ``n // 2 + 1``."""
    if not _is_int(n) or n < 2:
        raise ValueError(f"n must be an integer >= 2, got {n!r}")
    return n // 2 + 1


@dataclass(frozen=True)
class SecureParams:
    """The parameters of one secure-aggregation round of one cluster, the same on every device and the server.

    Parameters
    ----------
    ctx : bytes
        The round's context (:func:`round_context`).
    peers : tuple of (str, bytes)
        Every device of the round with its 32-byte X25519 public key, sorted by id, no id twice.
    threshold : int
        ``t``: the fewest devices whose shares rebuild a secret, ``2 <= t <= n``.
    modulus_bits : int
        ``m``: the masked updates are integers mod ``2**m``, ``8 <= m <= 32``.
    length : int
        The number of integer entries of an update (at least 1).

    Raises
    ------
    SecureError
        ``"peer"``, ``"threshold"``, ``"range"`` or ``"length"``: the parameters come in the server's
        command, so every check says which.
    """

    ctx: bytes
    peers: tuple[tuple[str, bytes], ...]
    threshold: int
    modulus_bits: int
    length: int
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.ctx, bytes) or not self.ctx:
            raise SecureError("range", "ctx must be non-empty bytes")
        try:
            peers = tuple((d, k) for d, k in self.peers)
        except (TypeError, ValueError):
            raise SecureError("peer", "peers must be pairs of (device id, public key)") from None
        object.__setattr__(self, "peers", peers)
        _check_peers(peers)
        n = len(peers)
        if not _is_int(self.threshold) or not 2 <= self.threshold <= n:
            raise SecureError("threshold", f"threshold must be an integer in [2, {n}], got {self.threshold!r}")
        if not _is_int(self.modulus_bits) or not 8 <= self.modulus_bits <= 32:
            raise SecureError("range", f"modulus_bits must be an integer in [8, 32], got {self.modulus_bits!r}")
        if not _is_int(self.length) or not 1 <= self.length <= 2 ** 31:
            raise SecureError("length", f"length must be an integer in [1, 2**31], got {self.length!r}")
        object.__setattr__(self, "_index", {d: i for i, (d, _) in enumerate(peers)})

    @property
    def n(self) -> int:
        """The number of devices of the round."""
        return len(self.peers)

    @property
    def ids(self) -> tuple[str, ...]:
        """The devices' ids, sorted."""
        return tuple(d for d, _ in self.peers)

    def index(self, device: str) -> int:
        """``device``'s place in :attr:`peers` (its Shamir x-coordinate is this plus 1)."""
        if device not in self._index:
            raise SecureError("peer", f"{device!r} is not a peer of this round")
        return self._index[device]

    def knows(self, device: object) -> bool:
        """Whether ``device`` is a peer of the round."""
        return isinstance(device, str) and device in self._index

    def public_key(self, device: str) -> bytes:
        """``device``'s 32-byte public key."""
        return self.peers[self.index(device)][1]


def _check_peers(peers: tuple) -> None:
    if not 2 <= len(peers) <= _MAX_PEERS:
        raise SecureError("peer", f"a round needs 2 to {_MAX_PEERS} peers, got {len(peers)}")
    for device, key in peers:
        encode_id(device)
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise SecureError("length", f"the public key of {device!r} must be {KEY_BYTES} bytes")
    ids = [d for d, _ in peers]
    for a, b in zip(ids, ids[1:]):
        if not a < b:
            raise SecureError("peer", f"peers must be sorted by id with no id twice: {a!r} before {b!r}")


def params_from_command(fields: Mapping[str, Any], rnd: int, key: str, n_values: int) -> SecureParams:
    """The round's parameters from a train command's ``secure`` record (``edge_sdk.schema``: peers, threshold, bits,
    run) for ``n_values`` float values; the server builds the same from what it sent. ``ValueError`` for a bad
    peer table."""
    from ..protocol import check_id
    from .quantize import SecureQuantizer, modulus_bits_for

    peers = []
    for cid, hexkey in fields["peers"].items():
        check_id(cid)
        if not isinstance(hexkey, str) or len(hexkey) != 64:
            raise ValueError(f"secure: the key of peer {cid!r} is not 64 hex digits")
        peers.append((cid, bytes.fromhex(hexkey)))
    m = modulus_bits_for(fields["bits"], len(peers))
    return SecureParams(round_context(fields["run"], rnd, key), tuple(sorted(peers)), fields["threshold"], m,
                        SecureQuantizer.length(n_values))
