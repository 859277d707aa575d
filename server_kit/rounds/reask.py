"""Asking a device for its update again, before the round's deadline, instead of losing it.

A device keeps its last update until the next one (``edge_sdk.client_state.SentUpdate``)
and sends it again when asked (the ``resend`` command). A round asks for it
again, while it still waits for the device, in two cases (:class:`ReaskWhy`):

- **busy**: the receiver (the server, or an ingest worker) had no room for
  the transfer beside the others in progress (the reassembler's memory bound:
  reason ``busy``). That is back-pressure, not a refusal: the round does not
  count it as an answer, and asks again after a delay that doubles with each
  try (``first_delay_s``, at most ``max_delay_s``, with a spread of +-25 % so
  that the devices told to wait together do not all come back together), as
  often as it takes;
- **lost**: the device said it sent its update (its status ``sent``) and,
  ``lost_after_s`` later, nothing of it arrived (asked again once); or the
  ingest worker that held it, or was to take it, died (asked again then).

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
    clock : callable
        Monotonic time (the clock of the sent claims too).
    """

    round: int
    first_delay_s: float = 1.0
    max_delay_s: float = 8.0
    lost_after_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _due: dict[str, tuple[float, ReaskWhy]] = field(default_factory=dict)
    _busy_tries: dict[str, int] = field(default_factory=dict)
    _lost: set[str] = field(default_factory=set)
    _last_ask: dict[str, float] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    #: Requests sent, per reason.
    asked: dict[ReaskWhy, int] = field(default_factory=dict)

    def busy(self, cid: str) -> float:
        """The receiver had no room for ``cid``'s update: when (seconds from now) it will be asked again."""
        tries = self._busy_tries[cid] = self._busy_tries.get(cid, 0) + 1
        delay = min(self.max_delay_s, self.first_delay_s * 2 ** (tries - 1)) * self._rng.uniform(0.75, 1.25)
        self._due[cid] = (self.clock() + delay, ReaskWhy.BUSY)
        return delay

    def lost(self, cid: str, *, again: bool = False) -> bool:
        """``cid``'s update is known lost: asked again now, unless it was once already (``again``: even so, for an
        update a dead ingest worker held); whether it will be."""
        if cid in self._lost and not again:
            return False
        self._lost.add(cid)
        self._due[cid] = (self.clock(), ReaskWhy.LOST)
        return True

    def due(self, awaited: Collection[str], sent: Mapping[str, tuple[int, float]]) -> list[tuple[str, ReaskWhy]]:
        """The requests to send now, among the devices still ``awaited``; counted as sent.

        ``sent``: each device's last "sent" claim, ``(round, when)`` on :attr:`clock`; a device still awaited,
        not waiting its turn, that said it sent this round's update :attr:`lost_after_s` ago (and was not asked
        again since) is lost.
        """
        now = self.clock()
        for cid, (rnd, when) in sent.items():
            since = max(when, self._last_ask.get(cid, when))
            if (rnd == self.round and now - since >= self.lost_after_s and cid in awaited and cid not in self._due
                    and cid not in self._lost):
                self.lost(cid)
        ready = sorted((cid, why) for cid, (at, why) in self._due.items() if at <= now)
        out = []
        for cid, why in ready:
            del self._due[cid]
            if cid in awaited:
                out.append((cid, why))
                self._last_ask[cid] = now
                self.asked[why] = self.asked.get(why, 0) + 1
        return out

    def to_dict(self) -> dict[str, int]:
        """The requests sent, per reason (the round's record)."""
        return {why.value: n for why, n in sorted(self.asked.items(), key=lambda kv: kv[0].value)}
