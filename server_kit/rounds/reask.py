"""Asking a device for its update again, before the round's deadline, instead of losing it.

A device keeps its last update until the next one (``edge_sdk.client.state.SentUpdate``)
and sends it when asked (the ``resend`` command). An update larger than the
round's ``announce_above`` bytes is not sent at once: the device announces it
(its status ``ready``, with its size), and the round asks for it (``GO``)
when its receiver (the server, or the ingest worker of its partition) has
room: at most ``budget_bytes`` of announced updates on their way to one
receiver, so that neither the receiver's reassembly memory nor the broker's
queue for it overflows when many large updates are ready at once. A round
asks for an update again, while it still waits for the device, in two cases:

- **busy**: the receiver (the server, or an ingest worker) had no room for
  the transfer beside the others in progress (the reassembler's memory bound:
  reason ``busy``). That is back-pressure, not a refusal: the round does not
  count it as an answer, and asks again after a delay that doubles with each
  try (``first_delay_s``, at most ``max_delay_s``, with a spread of +-25 % so
  that the devices told to wait together do not all come back together), as
  often as it takes;
- **lost**: the device said it sent its update (its status ``sent``) and,
  ``lost_after_s`` later, nothing of it arrived (asked again once); or the
  ingest worker that held it, or was to take it, died (asked again then);
- **reconnect**: the round still waits for the device's update and the
  server's connection to the broker, or that of the aggregator the update
  goes to, dropped and came back: what was in flight then may be gone (its
  update, its "sent"), so it is asked again once things settle, at each
  reconnection. A device still training says it has nothing yet and sends
  its update when done.

:class:`Reasks` only decides; the round's port sends the commands.
"""

from __future__ import annotations

import random
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from edge_sdk.protocol import BUSY

__all__ = ["BUSY", "ReaskWhy", "Reasks"]


class ReaskWhy(Enum):
    """Why a round asks a device for its update again."""

    #: The receiver had no room then: asked again after a growing delay, as often as it takes.
    BUSY = "busy"
    #: Sent (the device said so) and never arrived, or held by an ingest worker that died: asked again once.
    LOST = "lost"
    #: Announced (a large update, ready), and its receiver has room for it now: asked for the first time.
    GO = "go"
    #: Awaited when the server's or its receiver's connection to the broker dropped and came back: what was in
    #: flight then may be gone. Asked again once per reconnection.
    RECONNECT = "reconnect"


@dataclass
class Reasks:
    """One round's requests for updates again (see the module docstring).

    Parameters
    ----------
    round : int
    first_delay_s, max_delay_s : float
        The delay before asking a busy device again: ``first_delay_s`` the first time, doubled each time after,
        at most ``max_delay_s``.
    lost_after_s : float
        How long after a device said it sent its update the round takes it for lost.
    budget_bytes : int, optional
        Most bytes of announced updates asked for at once per receiver (the server, or each ingest worker's
        partition: ``receiver_of``); an update larger than the budget alone goes when its receiver has none in
        flight. None: every announced update is asked for at once.
    receiver_of : callable
        The receiver of a device's update (its ingest worker's partition; 0 without workers).
    clock : callable
        Monotonic time (the clock of the sent claims too).
    """

    round: int
    first_delay_s: float = 1.0
    max_delay_s: float = 8.0
    lost_after_s: float = 10.0
    budget_bytes: int | None = None
    receiver_of: Callable[[str], int] = field(default=lambda cid: 0)
    clock: Callable[[], float] = time.monotonic
    _due: dict[str, tuple[float, ReaskWhy]] = field(default_factory=dict)
    _size: dict[str, int] = field(default_factory=dict)
    _queue: list[str] = field(default_factory=list)
    _granted: set[str] = field(default_factory=set)
    _busy_tries: dict[str, int] = field(default_factory=dict)
    _lost: set[str] = field(default_factory=set)
    _last_ask: dict[str, float] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    #: Requests sent, per reason.
    asked: dict[ReaskWhy, int] = field(default_factory=dict)
    #: The name of a receiver (``receiver_of``'s value): its ingest worker's id, or "server".
    receiver_name: Callable[[int], str] = field(default=lambda receiver: "server")
    #: The devices taken for lost because nothing of their update reached its receiver ``lost_after_s`` after
    #: they said they sent it, by receiver.
    unanswered: dict[int, list[str]] = field(default_factory=dict)

    def busy(self, cid: str) -> float:
        """The receiver had no room for ``cid``'s update: when (seconds from now) it will be asked again."""
        tries = self._busy_tries[cid] = self._busy_tries.get(cid, 0) + 1
        self._granted.discard(cid)  # its bytes are not on their way any more
        delay = min(self.max_delay_s, self.first_delay_s * 2 ** (tries - 1)) * self._rng.uniform(0.75, 1.25)
        self._due[cid] = (self.clock() + delay, ReaskWhy.BUSY)
        return delay

    def lost(self, cid: str, *, again: bool = False, why: ReaskWhy = ReaskWhy.LOST) -> bool:
        """``cid``'s update is known lost: asked again now, unless it was once already (``again``: even so, for an
        update a dead ingest worker held, or one in flight when a connection dropped: ``why`` RECONNECT);
        whether it will be."""
        if cid in self._lost and not again:
            return False
        self._lost.add(cid)
        self._due[cid] = (self.clock(), why)
        return True

    def later(self, cid: str, delay_s: float, why: ReaskWhy) -> None:
        """Ask ``cid`` again ``delay_s`` from now (or sooner, if it is due sooner already); ``why`` says why."""
        at = self.clock() + float(delay_s)
        if cid not in self._due or self._due[cid][0] > at:
            self._due[cid] = (at, why)

    def due(self, awaited: Collection[str], sent: Mapping[str, tuple[int, float]],
            ready: Mapping[str, tuple[int, int]] | None = None) -> list[tuple[str, ReaskWhy]]:
        """The requests to send now, among the devices still ``awaited``; counted as sent.

        ``sent``: each device's last "sent" claim, ``(round, when)`` on :attr:`clock`; a device still awaited,
        not waiting its turn, that said it sent this round's update :attr:`lost_after_s` ago (and was not asked
        again since) is lost. ``ready``: each device's announced update, ``(round, bytes)``: asked for (``GO``)
        in the order announced, while its receiver's bytes in flight stay within :attr:`budget_bytes`.
        """
        now = self.clock()
        for cid, (rnd, size) in (ready or {}).items():
            if rnd == self.round and cid in awaited and cid not in self._size:
                self._size[cid] = int(size)
                self._queue.append(cid)
        for cid, (rnd, when) in sent.items():
            since = max(when, self._last_ask.get(cid, when))
            if (rnd == self.round and now - since >= self.lost_after_s and cid in awaited and cid not in self._due
                    and cid not in self._lost):
                self.lost(cid)
                self.unanswered.setdefault(self.receiver_of(cid), []).append(cid)
        out = []
        for cid, why in sorted((cid, why) for cid, (at, why) in self._due.items() if at <= now):
            del self._due[cid]
            if cid not in awaited:
                continue
            if cid in self._size and cid not in self._granted:
                self._queue.insert(0, cid)  # an announced update asked again waits for room first
            else:
                out.append((cid, why))
        out += self._grants(awaited)
        for cid, why in out:
            self._last_ask[cid] = now
            self.asked[why] = self.asked.get(why, 0) + 1
        return out

    def _grants(self, awaited: Collection[str]) -> list[tuple[str, ReaskWhy]]:
        """The announced updates whose receiver has room for them now, in the order they wait."""
        flight: dict[int, int] = {}
        for cid in self._granted:
            if cid in awaited:
                r = self.receiver_of(cid)
                flight[r] = flight.get(r, 0) + self._size[cid]
        out, waiting = [], []
        for cid in self._queue:
            if cid not in awaited:
                continue
            r, size = self.receiver_of(cid), self._size[cid]
            used = flight.get(r, 0)
            if self.budget_bytes is None or used == 0 or used + size <= self.budget_bytes:
                flight[r] = used + size
                self._granted.add(cid)
                first = cid not in self._busy_tries and cid not in self._lost
                out.append((cid, ReaskWhy.GO if first else ReaskWhy.BUSY))
            else:
                waiting.append(cid)
        self._queue = waiting
        return out

    def unreceipted(self) -> dict[str, int]:
        """The updates each receiver never answered (by :attr:`receiver_name`): the round's record."""
        return {self.receiver_name(r): len(cids) for r, cids in sorted(self.unanswered.items())}

    def to_dict(self) -> dict[str, int]:
        """The requests sent, per reason (the round's record)."""
        return {why.value: n for why, n in sorted(self.asked.items(), key=lambda kv: kv[0].value)}
