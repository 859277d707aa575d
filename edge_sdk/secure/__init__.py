"""Secure aggregation (after Bonawitz et al. 2017, adapted): the server learns the sum of the updates, no single one.

The pure core: numbers and bytes in, numbers and bytes out, no I/O. One round of one cluster::

    device u                                server
    --------                                ------
    DeviceSecureRound(keys, u, params)
    .mask(q_u) -> MaskedUpdate      ---->   ServerSecureRound(params).add_masked(...)
                                            .close() -> {w: UnmaskRequest}
    .reveal(request) -> Reveal      <--->   .add_reveal(...); .ready
                                            .unmask() -> sum of the survivors' q (int64)

Threat model
------------
Covered: an **honest-but-curious server** that follows the protocol and records every byte it
receives and sends, with the devices of **one cluster in one round**. It learns only the sum of the
quantised updates of the *survivors* (the devices whose masked update arrived before the close):

- a survivor's ``y_u`` carries, besides its self-mask ``PRG(b_u)`` (which the server rebuilds from
  ``t`` shares), its pair masks ``PRG(s_uv)`` with every other survivor ``v``; no device ever
  reveals a seed ``s_uv`` between two survivors, so ``y_u`` minus ``PRG(b_u)`` stays uniform noise
  and only the sum over the survivors, where those masks cancel, is clear;
- a device that drops **before** sending its masked update (or whose masked update comes after the
  close: refused, ``"closed"``) is cancelled out: the survivors reveal their pair seeds with it
  and its pair masks come off the sum; no share of its self-mask seed is ever revealed, so a late
  ``y`` of it stays masked;
- a device that drops **after** sending its masked update is counted (its self-mask seed comes back
  from the others' shares) and need not answer the unmask request, unless some device dropped
  before: then every survivor's reveal is needed (:class:`ServerSecureRound` refuses with
  ``"missing"``), since only the survivor and the dropped device know their pair seed;
- a device never reveals, for one round, both the share of a peer's self-mask seed and its pair
  seed with that peer (a second, different request of the round is refused: ``"both"``,
  ``"again"``), and every request needs at least ``t`` survivors;
- seeds are bound to the round (run, round, model: :func:`round_context`) by HKDF: revealing a
  pair seed for one round says nothing of the pair's long-term secret or of any other round.

Not covered, and stated here on purpose:

- a server that **lies about who dropped** to different devices (telling ``w1`` that ``v`` survived
  and ``w2`` that ``v`` dropped, to get both the share of ``b_v`` and a pair seed of ``v``):
  Bonawitz's consistency round (every survivor signs the survivor list) is not implemented;
- a server that **swaps public keys** (a man in the middle between two devices): the keys travel in
  the signed commands of that same server, so it could put its own keys there;
- devices that lie (a wrong pair seed goes unnoticed; a wrong share is caught only when more than
  ``t`` shares of a seed arrive, ``"share"``), collusion of the server with devices (fewer than ``t``
  colluders learn nothing of a seed, but a colluding peer of ``u`` knows its pair seeds with ``u``),
  and what the sum itself tells (differential privacy is the quantiser's caller's business).

Modules: :mod:`.errors` (:class:`SecureError`), :mod:`.params` (:class:`SecureParams`,
:func:`round_context`, :func:`default_threshold`), :mod:`.keys` (:class:`DeviceKeys`,
:func:`pair_secret`, the round's seeds), :mod:`.shamir`, :mod:`.prg`, :mod:`.packing`,
:mod:`.wire` (the strict reader), :mod:`.messages` (the three messages, their bytes), :mod:`.sizes`
(their sizes before they exist), :mod:`.device` (:class:`DeviceSecureRound`), :mod:`.server`
(:class:`ServerSecureRound`), :mod:`.quantize` (:class:`SecureQuantizer`).
"""

from __future__ import annotations

from .device import DeviceSecureRound
from .errors import SecureError
from .keys import DeviceKeys, mask_seed, pair_secret, share_key
from .messages import MaskedUpdate, Reveal, UnmaskRequest
from .packing import pack_bits, packed_size, to_signed, unpack_bits
from .params import SecureParams, default_threshold, round_context
from .prg import prg
from .quantize import SecureQuantizer, modulus_bits_for
from .server import ServerSecureRound
from .sizes import RoundSizes, masked_update_size, reveal_size, round_sizes, unmask_request_size

__all__ = [
    "DeviceKeys",
    "DeviceSecureRound",
    "MaskedUpdate",
    "Reveal",
    "RoundSizes",
    "SecureError",
    "SecureParams",
    "SecureQuantizer",
    "ServerSecureRound",
    "UnmaskRequest",
    "default_threshold",
    "mask_seed",
    "masked_update_size",
    "modulus_bits_for",
    "pack_bits",
    "packed_size",
    "pair_secret",
    "prg",
    "reveal_size",
    "round_context",
    "round_sizes",
    "share_key",
    "to_signed",
    "unmask_request_size",
    "unpack_bits",
]
