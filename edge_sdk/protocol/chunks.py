"""Chunks, the receiving side: payloads above a broker's message limit put back together.

Payloads cut into ``CHUNK`` envelopes (:mod:`.chunk_split`) are put back
together by a :class:`Reassembler`, which checks the whole payload's sha256,
holds no sender's transfers at the others' expense and forgets partial
transfers that stall. :func:`split_payload` and :func:`chunked_size` are
re-exported here.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from .chunk_split import chunked_size, split_payload
from .envelope import Kind, Message, ProtocolError

__all__ = [
    "BUSY",
    "DEFAULT_CHUNK_DEADLINE",
    "DEFAULT_CHUNK_MEMORY",
    "DEFAULT_CHUNK_PENDING_PER_SENDER",
    "DEFAULT_CHUNK_TIMEOUT",
    "Reassembler",
    "chunked_size",
    "split_payload",
]

log = logging.getLogger(__name__)

#: The reason a receiver refuses a transfer it has no room (or no round) for yet: its sender may send it again.
BUSY = "busy"

_CHUNK_KEYS = frozenset({"id", "i", "n", "size", "sha256", "k"})
_MAX_TRANSFER_ID = 64
_MAX_DONE = 1024
#: Reassembler defaults: a transfer idle this long is dropped (seconds).
DEFAULT_CHUNK_TIMEOUT = 60.0
#: ... and one not complete this long after its first chunk (seconds; a 45 MB
#: model needs about 10 minutes at 0.6 Mbit/s).
DEFAULT_CHUNK_DEADLINE = 600.0
#: ... most transfers in progress per (federation, sender).
DEFAULT_CHUNK_PENDING_PER_SENDER = 2
#: ... most bytes all pending transfers may declare together.
DEFAULT_CHUNK_MEMORY = 512 * 1024 * 1024
#: ... how long a chunk may be missing below one received before the transfer counts as cut (seconds).
DEFAULT_CHUNK_GAP = 5.0
#: Seconds without a chunk after which a transfer gives its room to a new one when the reassembler is full.
DEFAULT_CHUNK_EVICT_IDLE = 2.0
_INNER_KINDS = frozenset(int(k) for k in Kind if k != Kind.CHUNK)


def _int_field(meta: Mapping[str, Any], key: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError("chunk", f"chunk meta field {key!r} must be an integer, got {v!r}")
    return v


@dataclass
class _Partial:
    n: int
    size: int
    sha256: str
    kind: int | None
    started: float
    touched: float
    parts: dict[int, bytes] = field(default_factory=dict)
    received: int = 0
    #: The highest chunk index received.
    last: int = -1
    #: Since when a chunk below :attr:`last` is missing (None: none is).
    gap_since: float | None = None


class Reassembler:
    """Puts chunked payloads back together.

    Partial transfers are keyed by (federation, sender, transfer id), so one
    sender cannot complete or spoil another's. A transfer that would take the
    reassembler past its memory (``max_total_bytes``) or its count of
    transfers (``max_pending``) while others are in progress is refused as
    ``busy``: it is not the sender's fault, and its chunks are dropped
    quietly (:attr:`deferred_chunks`) so that the sender can be asked to send
    it again once there is room (the server does so: :mod:`server_kit.rounds.reask`).
    Before refusing, a full reassembler drops the transfers that sent nothing
    for ``evict_idle_s`` or more, longest idle first, if that makes room
    (:attr:`evicted`; their senders listed in :attr:`lost`): never-finished
    transfers from many senders cannot hold the room while honest ones,
    whose chunks come back to back, wait. A transfer with a chunk missing
    below one received for ``gap_s`` is refused as ``busy`` too: a
    sender's chunks come in order but for a reconnection's redeliveries, so
    the missing one was dropped on the way (a broker drops a slow subscriber's
    messages past its queue limits). It is dropped, its memory freed
    (:attr:`gaps`), at its next chunk or by :meth:`expire`. Every transfer
    :meth:`expire` drops (cut, stalled, overdue) is listed in :attr:`lost`
    for whoever can ask its sender again. Each sender also has its own
    budget (``max_pending_per_sender`` transfers, ``max_sender_bytes``
    declared bytes), checked after the global ones: a sender over its budget
    is refused without taking a slot or a byte from anyone else. A transfer
    is dropped when it stalls (``timeout_s`` since its last chunk) and at its
    deadline (``deadline_s`` since its first chunk), even while chunks keep
    dripping in. Expiry runs at every :meth:`feed`; call :meth:`expire`
    from a timer to free stalled transfers when no chunk comes. Not
    thread-safe: feed and expire it from one thread, or under one lock.

    Parameters
    ----------
    max_total_bytes : int
        Most bytes all pending transfers may declare together; a transfer that
        would exceed it is refused: ``busy`` while others are in progress (it
        may be sent again), ``oversized`` when it alone is larger.
    timeout_s : float
        A transfer that receives no chunk for this long is dropped (logged).
    max_pending : int
        Most transfers in progress at once (reason ``busy`` above it).
    max_size : int, optional
        Largest single transfer (reason ``oversized`` above it).
    clock : callable
        Monotonic time source, replaceable in tests.
    deadline_s : float
        A transfer not complete this long after its first chunk is dropped.
    max_pending_per_sender : int
        Most transfers in progress per (federation, sender) (reason ``pending``).
    max_sender_bytes : int, optional
        Most bytes the pending transfers of one (federation, sender) may
        declare together (reason ``oversized``). Default: ``max_size``, else
        ``max_total_bytes``.
    gap_s : float
        A chunk missing below a received one this long: the transfer is dropped as cut.
    evict_idle_s : float
        A transfer that sent no chunk this long gives its room to a new one when the reassembler is full.
    """

    def __init__(
        self,
        max_total_bytes: int = DEFAULT_CHUNK_MEMORY,
        timeout_s: float = DEFAULT_CHUNK_TIMEOUT,
        max_pending: int = 64,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_size: int | None = None,
        deadline_s: float = DEFAULT_CHUNK_DEADLINE,
        max_pending_per_sender: int = DEFAULT_CHUNK_PENDING_PER_SENDER,
        max_sender_bytes: int | None = None,
        gap_s: float = DEFAULT_CHUNK_GAP,
        evict_idle_s: float = DEFAULT_CHUNK_EVICT_IDLE,
    ) -> None:
        if max_total_bytes < 1 or max_pending < 1 or not timeout_s > 0:
            raise ValueError(
                "max_total_bytes and max_pending must be positive and timeout_s > 0, got "
                f"{max_total_bytes}, {max_pending}, {timeout_s}"
            )
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        if not evict_idle_s > 0:
            raise ValueError(f"evict_idle_s must be > 0, got {evict_idle_s!r}")
        if max_pending_per_sender < 1:
            raise ValueError(f"max_pending_per_sender must be positive, got {max_pending_per_sender!r}")
        if max_sender_bytes is not None and max_sender_bytes < 1:
            raise ValueError(f"max_sender_bytes must be positive, got {max_sender_bytes!r}")
        self.max_total_bytes = int(max_total_bytes)
        self.timeout_s = float(timeout_s)
        self.max_pending = int(max_pending)
        self.max_size = None if max_size is None else int(max_size)
        self.clock = clock
        self.deadline_s = float(deadline_s)
        self.max_pending_per_sender = int(max_pending_per_sender)
        self.gap_s = float(gap_s)
        self.evict_idle_s = float(evict_idle_s)
        if max_sender_bytes is None:
            max_sender_bytes = self.max_size if self.max_size is not None else self.max_total_bytes
        self.max_sender_bytes = int(max_sender_bytes)
        self._partials: dict[tuple[str, str, str], _Partial] = {}
        # Recently completed transfers: late duplicates (QoS 1 redeliveries) are ignored.
        self._done: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        #: Transfers dropped because they stalled (``timeout_s``), since creation.
        self.expired = 0
        #: Transfers dropped at their deadline (``deadline_s``), since creation.
        self.expired_deadline = 0
        #: Chunks refused by :meth:`feed` (every ProtocolError it raised), per reason.
        self.refused: dict[str, int] = {}
        # Transfers refused as busy: their later chunks are dropped without a word (counted).
        self._deferred: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        #: Chunks dropped because their transfer was refused as busy.
        self.deferred_chunks = 0
        #: Transfers dropped because chunks went missing on the way (a gap older than ``gap_s``).
        self.gaps = 0
        #: Transfers idle ``evict_idle_s`` or more that gave their room to a new transfer.
        self.evicted = 0
        #: The (federation, sender, inner kind) of the transfers :meth:`expire` dropped, until taken.
        self.lost: list[tuple[str, str, int | None]] = []

    def pending(self) -> int:
        """Number of transfers in progress."""
        return len(self._partials)

    def pending_bytes(self) -> int:
        """Bytes declared by the transfers in progress."""
        return sum(p.size for p in self._partials.values())

    def held_bytes(self) -> int:
        """Bytes of chunks actually held by the transfers in progress."""
        return sum(p.received for p in self._partials.values())

    def stats(self) -> dict[str, Any]:
        """Counters: ``pending``, ``pending_bytes``, ``held_bytes``, ``expired``
        (idle), ``expired_deadline``, ``refused`` (per reason) and ``deferred_chunks``."""
        return {
            "pending": self.pending(),
            "pending_bytes": self.pending_bytes(),
            "held_bytes": self.held_bytes(),
            "expired": self.expired,
            "expired_deadline": self.expired_deadline,
            "refused": dict(self.refused),
            "deferred_chunks": self.deferred_chunks,
            "gaps": self.gaps,
            "evicted": self.evicted,
        }

    def _sender_load(self, federation: str, sender: str) -> tuple[int, int]:
        """Transfers in progress and bytes they declare, for one (federation, sender)."""
        count = nbytes = 0
        for (fed, snd, _), p in self._partials.items():
            if fed == federation and snd == sender:
                count += 1
                nbytes += p.size
        return count, nbytes

    def expire(self) -> int:
        """Drop transfers idle for longer than ``timeout_s`` or older than
        ``deadline_s`` (counted from their first chunk); returns how many.

        Each dropped transfer is logged once, with its sender, the chunks
        received and its age.
        """
        now = self.clock()
        dropped = 0
        for key, p in list(self._partials.items()):
            if p.gap_since is not None and now - p.gap_since > self.gap_s and now - p.touched > self.gap_s:
                self.gaps += 1
                why = f"chunks missing below chunk {p.last} for {now - p.gap_since:.1f} s (dropped on the way?)"
            elif now - p.started > self.deadline_s:
                why = f"not complete {self.deadline_s:g} s after its first chunk"
                self.expired_deadline += 1
            elif now - p.touched > self.timeout_s:
                why = f"{now - p.touched:.1f} s without progress"
                self.expired += 1
            else:
                continue
            del self._partials[key]
            self._deferred[key] = now  # what may still come of it is dropped quietly
            self.lost.append((key[0], key[1], p.kind))
            dropped += 1
            log.warning(
                "dropped incomplete transfer %s from %s/%s: %d of %d chunks (%d of %d bytes), "
                "age %.1f s, %s",
                key[2], key[0], key[1], len(p.parts), p.n, p.received, p.size, now - p.started, why,
            )
        for seen in (self._done, self._deferred):
            while seen and (now - next(iter(seen.values())) > self.timeout_s or len(seen) > _MAX_DONE):
                seen.popitem(last=False)
        return dropped

    def _evict_idle(self, now: float, size: int) -> bool:
        """Make room for a new transfer of ``size`` bytes by dropping the transfers idle longest (each at least
        ``evict_idle_s``), if that is enough; returns whether it was (nothing is dropped otherwise).

        Transfers that are going on send chunks back to back, so the room of the full reassembler is held by the
        stalled ones: never-finished transfers, many senders' worth, give it up to whoever comes next, and their
        senders are listed in :attr:`lost` (an honest one among them is asked again).
        """
        idle = sorted((p.touched, key) for key, p in self._partials.items() if now - p.touched >= self.evict_idle_s)
        count, nbytes = len(self._partials), self.pending_bytes()
        chosen = []
        for _, key in idle:
            if count < self.max_pending and nbytes + size <= self.max_total_bytes:
                break
            chosen.append(key)
            count, nbytes = count - 1, nbytes - self._partials[key].size
        if not (count < self.max_pending and nbytes + size <= self.max_total_bytes):
            return False
        for key in chosen:
            p = self._partials.pop(key)
            self._deferred[key] = now
            self.lost.append((key[0], key[1], p.kind))
            self.evicted += 1
            log.info("transfer %s from %s/%s gave its room to a new one: %d of %d chunks, idle %.1f s",
                     key[2], key[0], key[1], len(p.parts), p.n, now - p.touched)
        return True

    def _validate(self, msg: Message) -> tuple[str, int, int, int, str, int | None]:
        if msg.kind != Kind.CHUNK:
            raise ProtocolError("kind", f"expected a CHUNK message, got {msg.kind.name}")
        m = msg.meta
        unknown = sorted(set(m) - _CHUNK_KEYS)
        if unknown:
            raise ProtocolError("chunk", f"chunk meta has unknown fields {unknown}")
        tid = m.get("id")
        if not isinstance(tid, str) or not 0 < len(tid) <= _MAX_TRANSFER_ID or not (tid.isascii() and tid.isalnum()):
            raise ProtocolError("chunk", f"chunk transfer id must be 1-{_MAX_TRANSFER_ID} alphanumerics, got {tid!r}")
        i, n, size = _int_field(m, "i"), _int_field(m, "n"), _int_field(m, "size")
        if not (n >= 1 and 0 <= i < n):
            raise ProtocolError("chunk", f"chunk index {i} of {n} is out of range")
        if size < 0 or n > max(size, 1):
            raise ProtocolError("chunk", f"chunk count {n} is impossible for a total of {size} bytes")
        if self.max_size is not None and size > self.max_size:
            raise ProtocolError("oversized", f"chunked payload of {size} bytes exceeds the limit of {self.max_size}")
        digest = m.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ProtocolError("chunk", f"chunk sha256 must be 64 lowercase hex digits, got {digest!r}")
        k = m.get("k")
        if k is not None and (isinstance(k, bool) or k not in _INNER_KINDS):
            raise ProtocolError("chunk", f"chunk inner kind {k!r} is not a message kind other than CHUNK")
        return tid, i, n, size, digest, k

    def feed(self, msg: Message) -> bytes | None:
        """Take one CHUNK message.

        Returns
        -------
        bytes or None
            The original payload once every chunk has arrived and its sha256
            matches; ``None`` while chunks are missing (and for an exact
            duplicate).

        Raises
        ------
        ProtocolError
            Reasons: ``kind``, ``chunk`` (malformed or inconsistent chunks;
            the transfer is dropped), ``oversized`` (too large for the limit
            on one transfer, on all pending transfers or on one sender's),
            ``busy`` (no room now beside the transfers in progress: once per
            transfer, whose later chunks are dropped), ``pending`` (too many
            transfers in progress from this sender), ``checksum``. Each is
            counted in :attr:`refused`.
        """
        try:
            return self._feed(msg)
        except ProtocolError as e:
            self.refused[e.reason] = self.refused.get(e.reason, 0) + 1
            raise

    def _admit(self, msg: Message, tid: str, size: int, now: float) -> None:
        """Make room for a new transfer of ``size`` bytes, or raise the ProtocolError that refuses it (``busy``
        defers it)."""
        key = (msg.federation, msg.sender, tid)
        if size > self.max_total_bytes:
            raise ProtocolError(
                "oversized",
                f"transfer {tid} of {size} bytes exceeds the {self.max_total_bytes} bytes allowed for "
                "pending transfers",
            )
        busy = (f"{len(self._partials)} transfers in progress, the most at once"
                if len(self._partials) >= self.max_pending else
                f"{self.pending_bytes()} of the {self.max_total_bytes} bytes allowed for pending transfers "
                "are taken" if self.pending_bytes() + size > self.max_total_bytes else None)
        count, nbytes = self._sender_load(msg.federation, msg.sender)
        if (busy is not None and count < self.max_pending_per_sender
                and nbytes + size <= self.max_sender_bytes and self._evict_idle(now, size)):
            busy = None
        if busy is not None:
            self._deferred[key] = now
            raise ProtocolError(BUSY, f"transfer {tid} of {size} bytes must wait its turn: {busy}")
        if count >= self.max_pending_per_sender:
            raise ProtocolError(
                "pending",
                f"sender {msg.sender!r} already has {count} transfers in progress (limit "
                f"{self.max_pending_per_sender} per sender); refusing transfer {tid}",
            )
        if nbytes + size > self.max_sender_bytes:
            raise ProtocolError(
                "oversized",
                f"transfer {tid} of {size} bytes from sender {msg.sender!r} would exceed the "
                f"{self.max_sender_bytes} bytes allowed per sender ({nbytes} pending)",
            )

    def _feed(self, msg: Message) -> bytes | None:
        self.expire()
        tid, i, n, size, digest, k = self._validate(msg)
        key = (msg.federation, msg.sender, tid)
        now = self.clock()
        if key in self._done:
            log.debug("late duplicate chunk %d of completed transfer %s ignored", i, tid)
            return None
        if key in self._deferred:
            self.deferred_chunks += 1
            return None
        part = self._partials.get(key)
        if part is None:
            self._admit(msg, tid, size, now)
            part = _Partial(n=n, size=size, sha256=digest, kind=k, started=now, touched=now)
            self._partials[key] = part
        elif (n, size, digest, k) != (part.n, part.size, part.sha256, part.kind):
            del self._partials[key]
            raise ProtocolError("chunk", f"chunk {i} of transfer {tid} disagrees with the earlier chunks; dropped")
        if i in part.parts:
            if part.parts[i] == msg.body:
                log.debug("duplicate chunk %d of transfer %s ignored", i, tid)
                return None
            del self._partials[key]
            raise ProtocolError("chunk", f"chunk {i} of transfer {tid} arrived twice with different bytes; dropped")
        if part.received + len(msg.body) > part.size:
            del self._partials[key]
            raise ProtocolError("chunk", f"transfer {tid} received more than its declared {part.size} bytes; dropped")
        if part.gap_since is not None and now - part.gap_since > self.gap_s:
            del self._partials[key]
            self._deferred[key] = now
            self.gaps += 1
            raise ProtocolError(BUSY, f"transfer {tid} has missed chunks below chunk {part.last} for "
                                      f"{now - part.gap_since:.1f} s (dropped on the way?); dropped, its sender "
                                      "is asked again")
        if i > part.last + 1 and part.gap_since is None:
            part.gap_since = now
        part.last = max(part.last, i)
        part.parts[i] = msg.body
        part.received += len(msg.body)
        part.touched = now
        if part.gap_since is not None and len(part.parts) == part.last + 1:
            part.gap_since = None  # the missing ones came (out of order)
        if len(part.parts) < part.n:
            return None
        del self._partials[key]
        self._done[key] = now
        payload = b"".join(part.parts[j] for j in range(part.n))
        if len(payload) != part.size:
            raise ProtocolError("chunk", f"transfer {tid} has {len(payload)} bytes, {part.size} declared")
        if hashlib.sha256(payload).hexdigest() != part.sha256:
            raise ProtocolError("checksum", f"transfer {tid} of {part.size} bytes fails its sha256 check")
        log.debug("reassembled transfer %s: %d chunks, %d bytes", tid, part.n, part.size)
        return payload
