"""One device's side of a secure-aggregation round: :class:`DeviceSecureRound` (mask, then reveal)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import SecureError
from .keys import DeviceKeys, mask_seed, pair_secret, share_key
from .messages import NONCE_BYTES, MaskedUpdate, Reveal, UnmaskRequest
from .packing import pack_bits
from .params import SecureParams, encode_id
from .prg import prg
from .shamir import SECRET_BYTES, share_from_bytes, share_to_bytes, split

__all__ = ["DeviceSecureRound", "share_associated_data"]


def share_associated_data(ctx: bytes, sender: str, to: str) -> bytes:
    """The AES-GCM associated data of the share ``sender`` seals for ``to``: ``ctx + id(sender) + id(to)``."""
    return ctx + encode_id(sender) + encode_id(to)


class DeviceSecureRound:
    """Device ``me``'s part in one round of one cluster: :meth:`mask` its update, then :meth:`reveal` once.

    Parameters
    ----------
    keys : DeviceKeys
        The device's key pair of the run; its public key must be the one ``params`` lists for ``me``.
    me : str
        The device's id, one of ``params.peers``.
    params : SecureParams
        The round.
    random_bytes : callable
        ``random_bytes(k)``: ``k`` random bytes for the self-mask seed, the Shamir coefficients and
        the nonces (:func:`os.urandom`; a seeded one in tests only).

    Raises
    ------
    SecureError
        ``"peer"``: ``me`` is not a peer; ``"key"``: the round lists another public key for ``me``,
        or a peer's key is a low-order point.
    """

    def __init__(self, keys: DeviceKeys, me: str, params: SecureParams,
                 random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        self.keys, self.me, self.params = keys, me, params
        params.index(me)
        if params.public_key(me) != keys.public_bytes:
            raise SecureError("key", f"the round lists another public key for {me!r}")
        self._random = random_bytes
        pair = {v: pair_secret(keys, pk) for v, pk in params.peers}
        self._seeds = {v: mask_seed(k, params.ctx) for v, k in pair.items() if v != me}
        self._share_keys = {v: share_key(k, params.ctx) for v, k in pair.items()}
        self._masked: MaskedUpdate | None = None
        self._answered: tuple[UnmaskRequest, Reveal] | None = None

    @property
    def masked(self) -> MaskedUpdate | None:
        """The masked update :meth:`mask` gave (to send again), or None before it."""
        return self._masked

    def mask(self, q: np.ndarray) -> MaskedUpdate:
        """The masked update of ``q`` (``length`` integers in ``[-2**(m-1), 2**(m-1))``), once per round.

        ``y = q + PRG(b) + sum_{v > me} PRG(s_v) - sum_{v < me} PRG(s_v) (mod 2**m)`` with a fresh
        self-mask seed ``b``, shared among all the peers (``me`` too) with the round's threshold, each
        share sealed with AES-GCM for its peer.
        """
        p, m = self.params, self.params.modulus_bits
        q = np.asarray(q)
        if q.shape != (p.length,) or not np.issubdtype(q.dtype, np.integer):
            raise ValueError(f"q must be {p.length} integers, got {q.dtype} of shape {q.shape}")
        half = 1 << (m - 1)
        if int(q.min()) < -half or int(q.max()) >= half:
            raise ValueError(f"q must lie in [-2**{m - 1}, 2**{m - 1})")
        if self._masked is not None:
            raise RuntimeError("this round's update is already masked: send .masked again")
        b = self._random(SECRET_BYTES)
        shares = split(b, p.n, p.threshold, self._random)
        sealed = {v: self._seal(v, share_to_bytes(s)) for (v, _), s in zip(p.peers, shares)}
        y = q.astype(np.int64).astype(np.uint32)  # two's complement: mod 2**32, then mod 2**m
        y += prg(b, p.length, m)
        for v, seed in self._seeds.items():
            if v > self.me:
                y += prg(seed, p.length, m)
            else:
                y -= prg(seed, p.length, m)
        y &= np.uint32((1 << m) - 1)
        self._masked = MaskedUpdate(self.me, pack_bits(y, m), sealed)
        return self._masked

    def _seal(self, to: str, share: bytes) -> bytes:
        nonce = self._random(NONCE_BYTES)
        ad = share_associated_data(self.params.ctx, self.me, to)
        return nonce + AESGCM(self._share_keys[to]).encrypt(nonce, share, ad)

    def _open(self, sender: str, sealed: bytes) -> bytes:
        ad = share_associated_data(self.params.ctx, sender, self.me)
        try:
            share = AESGCM(self._share_keys[sender]).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], ad)
        except InvalidTag:
            raise SecureError("tag", f"unmask request: the share from {sender!r} does not open (another key, "
                                     f"round or addressee, or altered)") from None
        share_from_bytes(share)
        return share

    def reveal(self, request: UnmaskRequest) -> Reveal:
        """The answer to the server's request: the survivors' shares opened, the pair seeds with the dropped.

        Refused (:class:`.SecureError`) unless the device masked its update, every name is a peer,
        survivors and dropped split the peers, ``me`` survived, at least ``t`` survived and every
        survivor's share is there and opens.
        A second request of the round gets the same answer if it is the same request, and is refused
        otherwise: ``"both"`` if a device moved between survivors and dropped (answering would give
        both the share of its ``b`` and the pair seed with it), ``"again"`` for any other difference.
        """
        request.check(self.params)
        if self._masked is None:
            raise SecureError("order", f"unmask request: {self.me!r} sent no masked update this round, "
                                       "so it cannot be a survivor")
        if self._answered is not None:
            first, answer = self._answered
            if request == first:
                return answer
            self._refuse_second(first, request)
        self._check_request(request)
        b_shares = {v: self._open(v, request.shares_for_you[v]) for v in request.survivors}
        answer = Reveal(self.me, b_shares, {v: self._seeds[v] for v in request.dropped})
        self._answered = (request, answer)
        return answer

    def _refuse_second(self, first: UnmaskRequest, request: UnmaskRequest) -> None:
        moved = sorted((set(first.survivors) & set(request.dropped))
                       | (set(first.dropped) & set(request.survivors)))
        if moved:
            raise SecureError("both", f"unmask request: a second request of this round moves {moved[0]!r} "
                                      "between survivors and dropped: refused, it would reveal both its share "
                                      "and its pair seed")
        raise SecureError("again", "unmask request: a second request of this round differs from the first")

    def _check_request(self, request: UnmaskRequest) -> None:
        p, what = self.params, "unmask request"
        survivors, dropped = set(request.survivors), set(request.dropped)
        both = sorted(survivors & dropped)
        if both:
            raise SecureError("both", f"{what}: {both[0]!r} is both a survivor and dropped")
        left_out = [d for d in p.ids if d not in survivors | dropped]
        if left_out:
            raise SecureError("peer", f"{what}: {left_out[0]!r} is neither a survivor nor dropped")
        if self.me not in survivors:
            raise SecureError("peer", f"{what}: {self.me!r} is not among the survivors")
        if len(survivors) < p.threshold:
            raise SecureError("threshold",
                              f"{what}: {len(survivors)} survivors, fewer than the threshold {p.threshold}")
        for v in request.survivors:
            if v not in request.shares_for_you:
                raise SecureError("share", f"{what}: no share from the survivor {v!r}")
        for v in request.shares_for_you:
            if v not in survivors:
                raise SecureError("peer", f"{what}: a share from {v!r}, which is not a survivor")
