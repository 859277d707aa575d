"""Each device's X25519 key pair and the secrets two devices share: :class:`DeviceKeys`, :func:`pair_secret`.

Two devices ``u`` and ``v`` agree on ``k_uv = HKDF-SHA256(X25519(sk_u, pk_v), info=b"fedsketch-secagg-pair")``
without talking (``k_uv = k_vu``). Each round derives from it, bound to the round's context ``ctx``
(:func:`.params.round_context`), a mask seed ``s_uv`` (:func:`mask_seed`) and an AES-GCM key ``e_uv``
(:func:`share_key`). HKDF is one-way: a revealed ``s_uv`` tells nothing of ``k_uv``, of ``e_uv`` or
of any other round's seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import SecureError
from .params import KEY_BYTES

__all__ = ["DeviceKeys", "derive", "mask_seed", "pair_secret", "share_key"]

_PAIR_INFO = b"fedsketch-secagg-pair"
_RAW = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class DeviceKeys:
    """One device's X25519 key pair, one per run.

    Build it with :meth:`generate` or :meth:`from_private_bytes`; keep :attr:`private_bytes` secret
    and publish :attr:`public_bytes`.
    """

    _private: X25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls) -> DeviceKeys:
        """A fresh key pair from the operating system's randomness."""
        return cls(X25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, data: bytes) -> DeviceKeys:
        """The key pair of a 32-byte private key (as :attr:`private_bytes` gave it)."""
        if not isinstance(data, bytes) or len(data) != KEY_BYTES:
            raise ValueError(f"an X25519 private key is {KEY_BYTES} bytes")
        return cls(X25519PrivateKey.from_private_bytes(data))

    @property
    def public_bytes(self) -> bytes:
        """The 32-byte public key."""
        return self._private.public_key().public_bytes(*_RAW)

    @property
    def private_bytes(self) -> bytes:
        """The 32-byte private key: keep it on the device."""
        return self._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())

    def exchange(self, peer_public: bytes) -> bytes:
        """The raw X25519 shared secret with a peer's public key (use :func:`pair_secret`)."""
        if not isinstance(peer_public, bytes) or len(peer_public) != KEY_BYTES:
            raise SecureError("length", f"a public key is {KEY_BYTES} bytes")
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:  # a low-order point: the shared secret would be all zeros
            raise SecureError("key", "the peer's public key is a low-order point") from None


def derive(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 of ``secret`` with no salt and ``info``: ``length`` bytes."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def pair_secret(keys: DeviceKeys, peer_public: bytes) -> bytes:
    """``k_uv``: the 32-byte secret this device shares with the owner of ``peer_public`` (symmetric)."""
    return derive(keys.exchange(peer_public), _PAIR_INFO)


def mask_seed(k_uv: bytes, ctx: bytes) -> bytes:
    """``s_uv = HKDF(k_uv, info=b"mask" + ctx)``: the 32-byte seed of the pair's mask in this round."""
    return derive(k_uv, b"mask" + ctx)


def share_key(k_uv: bytes, ctx: bytes) -> bytes:
    """``e_uv = HKDF(k_uv, info=b"share" + ctx)``: the AES-256-GCM key of the pair's shares in this round."""
    return derive(k_uv, b"share" + ctx)
