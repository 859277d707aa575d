"""The server's side of a secure-aggregation round: :class:`ServerSecureRound` (collect, close, collect, unmask)."""

from __future__ import annotations

import numpy as np

from .errors import SecureError
from .messages import MaskedUpdate, Reveal, UnmaskRequest
from .packing import to_signed, unpack_bits
from .params import SecureParams
from .prg import prg
from .shamir import reconstruct, share_from_bytes

__all__ = ["ServerSecureRound"]


class ServerSecureRound:
    """One round of one cluster on the server: it learns the sum of the survivors' updates and nothing else.

    1. :meth:`add_masked` each masked update as it arrives;
    2. :meth:`close`: the senders are the survivors, the others dropped; one :class:`.UnmaskRequest`
       per survivor;
    3. :meth:`add_reveal` each survivor's :class:`.Reveal`; :attr:`ready` once enough came;
    4. :meth:`unmask`: the sum of the survivors' updates, ``int64``.

    Messages may come as objects or as bytes (read with the round's parameters). :attr:`bytes_in`
    counts the bytes of the messages accepted, :attr:`bytes_out` those of the requests sent.
    """

    def __init__(self, params: SecureParams) -> None:
        self.params = params
        self.bytes_in = 0
        self.bytes_out = 0
        self._updates: dict[str, MaskedUpdate] = {}
        self._requests: dict[str, UnmaskRequest] | None = None
        self._closed = False
        self._reveals: dict[str, Reveal] = {}

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (masked updates are refused from then on)."""
        return self._closed

    @property
    def survivors(self) -> tuple[str, ...]:
        """The devices whose masked update arrived (before the close: so far), in the peers' order."""
        return tuple(d for d in self.params.ids if d in self._updates)

    @property
    def dropped(self) -> tuple[str, ...]:
        """The devices whose masked update did not arrive by the close (before the close: none)."""
        return tuple(d for d in self.params.ids if d not in self._updates) if self._closed else ()

    @property
    def requests(self) -> dict[str, UnmaskRequest]:
        """The unmask requests :meth:`close` made, per survivor (to send again); empty before."""
        return dict(self._requests or {})

    @property
    def revealed(self) -> tuple[str, ...]:
        """The survivors whose reveal was accepted, in the peers' order."""
        return tuple(d for d in self.params.ids if d in self._reveals)

    def add_masked(self, update: MaskedUpdate | bytes) -> MaskedUpdate:
        """Accepts one device's masked update (once per device, before the close).

        Raises
        ------
        SecureError
            Its bytes or fields are wrong (``"length"``, ``"peer"``, ``"kind"``...); ``"closed"``: the
            round is closed; ``"again"``: a second one from the same device.
        """
        if not isinstance(update, MaskedUpdate):
            update = MaskedUpdate.from_bytes(update, self.params)
        update.check(self.params)
        if self._closed:
            raise SecureError("closed", f"masked update: from {update.sender!r} after the close, not counted")
        if update.sender in self._updates:
            raise SecureError("again", f"masked update: a second one from {update.sender!r}")
        self._updates[update.sender] = update
        self.bytes_in += update.wire_size
        return update

    def close(self) -> dict[str, UnmaskRequest]:
        """Ends the masked updates: one :class:`.UnmaskRequest` per survivor, with the shares addressed to it.

        Raises
        ------
        SecureError
            ``"threshold"``: fewer survivors than the threshold (the round is lost: nothing can be unmasked).
        RuntimeError
            The round is already closed (:attr:`requests` holds the requests).
        """
        if self._closed:
            raise RuntimeError("the round is already closed")
        self._closed = True
        survivors, dropped, t = self.survivors, self.dropped, self.params.threshold
        if len(survivors) < t:
            raise SecureError("threshold", f"{len(survivors)} masked updates, fewer than the threshold {t}: "
                                           "the round cannot be unmasked")
        self._requests = {w: UnmaskRequest(survivors, dropped, {v: self._updates[v].shares[w] for v in survivors})
                          for w in survivors}
        self.bytes_out += sum(r.wire_size for r in self._requests.values())
        return dict(self._requests)

    def add_reveal(self, reveal: Reveal | bytes) -> Reveal:
        """Accepts one survivor's reveal (once), which must answer the request it was sent.

        Raises
        ------
        SecureError
            Its bytes or fields are wrong; ``"order"``: the round is not closed; ``"peer"``: not from a
            survivor, or naming someone it should not; ``"again"``: a second one; ``"share"`` or
            ``"seed"``: a share or a pair seed missing.
        """
        if not isinstance(reveal, Reveal):
            reveal = Reveal.from_bytes(reveal, self.params)
        reveal.check(self.params)
        if self._requests is None:
            raise SecureError("order", f"reveal: from {reveal.sender!r} before the round is closed and unmaskable")
        w, survivors, dropped = reveal.sender, self.survivors, self.dropped
        if w not in survivors:
            raise SecureError("peer", f"reveal: {w!r} is not a survivor")
        if w in self._reveals:
            raise SecureError("again", f"reveal: a second one from {w!r}")
        _same_names(f"reveal from {w!r}", "share", reveal.b_shares, survivors)
        _same_names(f"reveal from {w!r}", "seed", reveal.pair_seeds, dropped)
        self._reveals[w] = reveal
        self.bytes_in += reveal.wire_size
        return reveal

    @property
    def ready(self) -> bool:
        """Whether :meth:`unmask` can run: at least ``t`` reveals, and every survivor's if any device dropped."""
        if self._requests is None or len(self._reveals) < self.params.threshold:
            return False
        return not self.dropped or len(self._reveals) == len(self.survivors)

    def unmask(self) -> np.ndarray:
        """The sum of the survivors' updates, ``int64`` (``m``-bit two's complement), exactly.

        Each survivor's self-mask seed comes back from the revealed shares (all of them checked to
        lie on one polynomial); the pair masks between a survivor and a dropped device, which did
        not cancel, come off with the survivor's revealed pair seed.

        Raises
        ------
        SecureError
            ``"threshold"``: fewer than ``t`` reveals (or not closed); ``"missing"``: a device
            dropped and a survivor sent no reveal, so its pair masks with the dropped device cannot
            be removed; ``"share"``: the shares of a seed disagree (a device lied).
        """
        p, m, t = self.params, self.params.modulus_bits, self.params.threshold
        if self._requests is None or len(self._reveals) < t:
            raise SecureError("threshold", f"{len(self._reveals)} reveals, fewer than the threshold {t}")
        silent = [w for w in self.survivors if w not in self._reveals]
        if self.dropped and silent:
            raise SecureError("missing", f"{silent[0]!r} sent no reveal: its pair masks with the dropped "
                                         f"{self.dropped[0]!r} cannot be removed")
        total = np.zeros(p.length, dtype=np.uint32)
        for w in self.survivors:
            total += unpack_bits(self._updates[w].y, p.length, m)
            total -= prg(self._self_seed(w), p.length, m)
        for w, reveal in self._reveals.items():
            for v, seed in reveal.pair_seeds.items():
                if v > w:  # w added +PRG(s_wv) for a later v, -PRG(s_wv) for an earlier one
                    total -= prg(seed, p.length, m)
                else:
                    total += prg(seed, p.length, m)
        return to_signed(total, m)

    def _self_seed(self, w: str) -> bytes:
        """``b_w``, rebuilt from every revealed share of it."""
        points = {self.params.index(u) + 1: share_from_bytes(r.b_shares[w]) for u, r in self._reveals.items()}
        try:
            return reconstruct(points, self.params.threshold)
        except SecureError as e:
            raise SecureError(e.reason, f"the shares of {w!r}'s self-mask seed: {e}") from None


def _same_names(what: str, reason: str, got: dict, expected: tuple[str, ...]) -> None:
    for d in expected:
        if d not in got:
            raise SecureError(reason, f"{what}: no {reason} for {d!r}")
    for d in got:
        if d not in expected:
            raise SecureError("peer", f"{what}: a {reason} for {d!r}, which it was not asked for")
