"""Chunks, the sending side: a payload above a broker's message limit cut into ``CHUNK`` envelopes.

:func:`split_payload` cuts; :func:`chunked_size` tells how many bytes those envelopes take, without cutting
anything. The receiving side, which puts them back together, is :mod:`.chunks`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from typing import Any

from .envelope import HEADER_SIZE, MAGIC, Kind, Message, encode_message

__all__ = ["chunked_size", "split_payload"]

log = logging.getLogger(__name__)


def split_payload(
    payload: bytes, *, max_payload: int, federation: str, sender: str, round: int = 0
) -> list[bytes]:
    """Cut a payload into CHUNK envelopes of at most ``max_payload`` bytes each.

    Parameters
    ----------
    payload : bytes
        Usually an encoded envelope that is too large for the broker.
    max_payload : int
        Largest encoded chunk, in bytes.
    federation, sender : str
        Ids written into every chunk (the receiver checks the sender against
        the topic, as for any message).
    round : int
        Round written into every chunk.

    Returns
    -------
    list of bytes
        ``[payload]`` unchanged when it fits; otherwise encoded CHUNK messages
        whose meta holds the transfer ``id``, index ``i``, count ``n``, total
        ``size``, the whole payload's ``sha256`` and, for an envelope, the
        inner message kind ``k`` (so byte counts can be attributed).
    """
    payload = bytes(payload)
    if len(payload) <= max_payload:
        return [payload]
    total = len(payload)
    digest = hashlib.sha256(payload).hexdigest()
    transfer = secrets.token_hex(8)
    inner_kind = payload[3] if payload[:2] == MAGIC and len(payload) >= HEADER_SIZE else None
    step = _chunk_step(max_payload, _chunk_meta(transfer, total, total, total, digest, inner_kind),
                       federation=federation, sender=sender, round=round)
    n = math.ceil(total / step)
    chunks = []
    for i in range(n):
        piece = payload[i * step : (i + 1) * step]
        meta = _chunk_meta(transfer, i, n, total, digest, inner_kind)
        chunk = encode_message(Message(Kind.CHUNK, federation, sender, round, meta, piece))
        chunks.append(chunk)
    log.debug("split %d bytes into %d chunks of at most %d bytes (transfer %s)", total, n, max_payload, transfer)
    return chunks


def chunked_size(
    total: int, *, max_payload: int, federation: str, sender: str, round: int = 0, inner_kind: int | None = None
) -> int:
    """Bytes :func:`split_payload` would send for a ``total``-byte payload, computed without cutting it.

    Parameters
    ----------
    total : int
        Length of the payload, in bytes.
    max_payload, federation, sender, round
        As for :func:`split_payload`.
    inner_kind : int, optional
        The payload's message kind when it is an envelope (its byte 3), as
        :func:`split_payload` writes it into every chunk's meta.

    Returns
    -------
    int
        ``total`` when it fits in ``max_payload``; otherwise the sum of the
        lengths of the CHUNK envelopes. :meth:`Message.wire_size` uses it.

    Raises
    ------
    ValueError
        When ``max_payload`` leaves no room for data after a chunk header.
    """
    if total <= max_payload:
        return total
    # The transfer id and the sha256 have fixed widths: placeholders of those widths size the real ones.
    transfer, digest = "0" * 16, "0" * 64
    step = _chunk_step(max_payload, _chunk_meta(transfer, total, total, total, digest, inner_kind),
                       federation=federation, sender=sender, round=round)
    n = math.ceil(total / step)
    # Every chunk's header is the first one's, except for the digits of its index ``i``.
    first = Message(Kind.CHUNK, federation, sender, round, _chunk_meta(transfer, 0, n, total, digest, inner_kind))
    return n * (first.wire_size() - 1) + sum(len(str(i)) for i in range(n)) + total


def _chunk_meta(transfer: str, i: int, n: int, total: int, digest: str, inner_kind: int | None) -> dict[str, Any]:
    """The meta of chunk ``i`` of ``n`` of a transfer."""
    m: dict[str, Any] = {"id": transfer, "i": i, "n": n, "size": total, "sha256": digest}
    if inner_kind is not None:
        m["k"] = inner_kind
    return m


def _chunk_step(max_payload: int, worst_meta: dict[str, Any], *, federation: str, sender: str, round: int) -> int:
    """Bytes of payload each chunk carries, given the widest chunk meta."""
    # Upper bound of the envelope overhead: index and count as wide as the payload's length.
    worst = Message(Kind.CHUNK, federation, sender, round, worst_meta).wire_size()
    step = max_payload - worst
    if step < 1:
        raise ValueError(f"max_payload={max_payload} leaves no room for data after the {worst}-byte chunk header")
    return step
