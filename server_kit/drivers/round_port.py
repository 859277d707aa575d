"""The MQTT side of a training round: models and ``train`` commands out, the answers in until the close.

:class:`MqttRoundPort` is the :class:`~server_kit.rounds.training.RoundPort`
of the orchestrator: it tells the ingest workers (if any) what the round's
updates start from, delivers each task's models (once per cluster topic where
it can, per device otherwise: :mod:`.delivery`), sends each device its
``train`` command, and pumps the link until the round may close
(:func:`~server_kit.rounds.closing.wait_round`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from edge_sdk.compress.update_codec import UpdateCodec
from edge_sdk.protocol import Kind, partition_of
from edge_sdk.protocol.commands import Op, build
from edge_sdk.tasks import Task

from ..rounds.arrivals import PartialSum
from ..rounds.closing import ClosePolicy, wait_round
from ..rounds.pace import Pace
from ..rounds.reask import ReaskWhy
from ..rounds.round_wait import RoundClose, RoundWait
from ..strategies.base import Strategy
from .config import ServerConfig
from .delivery import Delivery
from .fleet import Fleet
from .link import ServerLink
from .remote import RemoteRound

if TYPE_CHECKING:
    from ..privacy.secure_sum import SecureSums

__all__ = ["MqttRoundPort"]

log = logging.getLogger(__name__)

#: How often a waiting round looks for updates to ask for again (seconds).
REASK_TICK_S = 0.2
#: After the server reconnects to the broker, how long the round lets the aggregators and devices reconnect and
#: subscribe again before it asks for the updates it still waits for.
RECONNECT_SETTLE_S = 2.0


class MqttRoundPort:
    """A round's messages over MQTT (see the module docstring)."""

    def __init__(self, *, strategy: Strategy, config: ServerConfig, link: ServerLink, fleet: Fleet,
                 delivery: Delivery, pace: Pace, codec: UpdateCodec, architecture: Callable[[], str | None],
                 deadline: Callable[[int], float], remote: RemoteRound | None = None) -> None:
        self.strategy = strategy
        self.config = config
        self.link = link
        self.fleet = fleet
        self.delivery = delivery
        self.pace = pace
        self.codec = codec
        self.architecture = architecture
        self.deadline = deadline
        self._remote = remote
        #: The link's (re)connections to the broker, counted by its network thread, and those acted on.
        self._connections = self._connections_seen = 0
        on_connected = getattr(link.transport, "on_connected", None)
        if on_connected is not None:
            on_connected(self._count_connection)

    def _count_connection(self) -> None:
        self._connections += 1

    def online_ids(self) -> Collection[str]:
        return self.fleet.online_ids

    def send(self, rnd: int, tasks: Sequence[Task], *, secure: Mapping[str, Any] | None = None
             ) -> tuple[int, dict[str, int]]:
        """The workers learn what the updates start from; each device gets its models (IFCA: all K), its command
        (with ``secure``: its record of the round's secure group)."""
        if self._remote is not None:
            self._remote.open(rnd, {k for t in tasks for k in t.models})
        delivered, deliveries = self.delivery.deliver_models({t.cid: list(t.models) for t in tasks},
                                                             self.strategy.models, self.strategy.versions)
        log.info("round %d: models once on %d cluster topic(s), %d copies per device", rnd,
                 deliveries["cluster_topic"], deliveries["per_device"])
        arch = self.architecture()
        extra: dict[str, Any] = {"architecture": arch} if arch else {}
        extra.update(self.codec.command_meta)  # how the devices send their updates
        extra["announce_above"] = self.config.announce_above_bytes  # a large one when its receiver has room
        ingest = None if self._remote is None else self._remote.ingest
        for t in tasks:
            if ingest is not None:  # its update goes to the ingest worker of its partition
                extra["partition"] = partition_of(t.cid, ingest.partitions)
            group = {"secure": secure[t.cid]} if secure else {}
            self.link.command(t.cid, Op.TRAIN, round=rnd, models=sorted(t.models), evaluate_first=t.evaluate_first,
                              **extra, **group, **t.settings.to_dict())
        return delivered, deliveries

    def unmask(self, rnd: int, secure: SecureSums) -> list[PartialSum]:
        """Close the round's secure groups, send each survivor its unmask request, wait for the reveals (every
        survivor's, or ``reveal_timeout_s``), and return each group's sum."""
        asks = secure.close()
        for cid, (key, body) in sorted(asks.items()):
            self.link.send(self.link.topics.cmd(cid), Kind.CMD, meta=build(Op.UNMASK, round=rnd, model_key=key),
                           body=body)
        if asks:
            self.link.pump(secure.complete, secure.settings.reveal_timeout_s)
        return secure.sums(self.strategy.models)

    def wait(self, rnd: int, wait: RoundWait) -> RoundClose:
        """Pump until the round may close (goal and grace, deadline, plausible claims)."""
        c = self.config
        policy = ClosePolicy(deadline_s=self.deadline(rnd), max_round_s=c.max_round_s or 10 * c.round_timeout_s,
                             progress_grace_s=c.progress_grace_s, straggler_grace=c.straggler_grace)
        clients = self.fleet.clients
        reasks = wait.reasks
        reasks.lost_after_s, reasks.budget_bytes = c.reask_lost_s, c.transfer_budget_bytes
        ingest = None if self._remote is None else self._remote.ingest
        if ingest is not None:
            reasks.receiver_of = lambda cid: partition_of(cid, ingest.partitions)
            reasks.receiver_name = lambda p: ingest.workers[p]

        def claims() -> dict[str, tuple[int, float]]:
            return {cid: w for cid in wait.left if (w := clients[cid].working) is not None}

        def pump(until: Callable[[], bool], timeout: float) -> bool:
            """The link's pump, asking for updates again (:mod:`~server_kit.rounds.reask`) every 0.2 s or so."""
            end = time.monotonic() + timeout
            while True:
                self.ask_again(wait)
                left = end - time.monotonic()
                if self.link.pump(until, max(0.0, min(left, REASK_TICK_S))) or left <= REASK_TICK_S:
                    return until()

        return wait_round(pump, wait, policy, self.pace, claims)

    def ask_again(self, wait: RoundWait) -> None:
        """Start dead ingest workers again; send the ``resend`` commands the round's
        :class:`~server_kit.rounds.reask.Reasks` says are due (the lost updates of a dead worker among them)."""
        clients = self.fleet.clients
        sent = {cid: s for cid in wait.left if (s := clients[cid].sent) is not None}
        ready = {cid: s for cid in wait.left if (s := clients[cid].ready) is not None}
        if self._remote is not None:
            for cid in self._remote.revive(wait, sent):
                wait.reasks.lost(cid, again=True)
        self._after_reconnections(wait)
        reasks = wait.reasks
        for cid, why in reasks.due(wait.left, sent, ready):
            receiver = reasks.receiver_of(cid)
            if why is ReaskWhy.LOST and cid in reasks.unanswered.get(receiver, ()) and cid in sent:
                log.warning("round %d: %s never took %s's update (said sent %.1f s ago%s): asking %s again",
                            wait.round, reasks.receiver_name(receiver), cid, time.monotonic() - sent[cid][1],
                            "" if self._remote is None or self._remote.ingest is None else
                            f" on partition {receiver}", cid)
            else:
                log.log(logging.DEBUG if why is ReaskWhy.GO else logging.INFO,
                        "round %d: asking %s for its update%s (%s)", wait.round, cid,
                        "" if why is ReaskWhy.GO else " again", why.value)
            self.link.command(cid, Op.RESEND, round=wait.round)

    def _after_reconnections(self, wait: RoundWait) -> None:
        """The server's connection, or an aggregator's, came back: ask again, once things settle, for the
        updates the round still waits for, which may have been in flight then (:attr:`ReaskWhy.RECONNECT`)."""
        lost: dict[str, tuple[list[str], float]] = {}
        if self._connections != self._connections_seen:
            self._connections_seen = self._connections
            # the aggregators and devices reconnect too, with back-off: their subscriptions may lag the server's
            lost["the server"] = (sorted(wait.left), RECONNECT_SETTLE_S)
        if self._remote is not None:
            lost.update({aid: (cids, 0.0) for aid, cids in self._remote.reconnected(wait).items()})
        for who, (cids, delay) in lost.items():
            if cids:
                log.warning("round %d: %s reconnected to the broker; asking again in %g s for the %d update(s) it "
                            "still waits for, which may have been in flight: %s", wait.round, who, delay, len(cids),
                            ", ".join(cids[:10]) + (" ..." if len(cids) > 10 else ""))
            for cid in cids:
                wait.reasks.later(cid, delay, ReaskWhy.RECONNECT)

    def remote(self) -> RemoteRound | None:
        return self._remote

    def bench(self, cid: str, reason: str) -> None:
        self.fleet.bench(cid, reason)
