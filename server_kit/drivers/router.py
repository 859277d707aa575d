"""Each device message to whom it concerns: the server's one handler of what its link receives.

:class:`MessageRouter` checks a message against the schema and hands it on:
a hello to the fleet (admitted now, or once the models are chosen; placed if
it arrives during training), a status to the fleet and the model delivery, a
sketch to the intake (a late device placed, a fresh sketch kept for the next
round), an update to the intake (the round's, or pre-training's), metrics to
the final evaluation, an aggregator's receipt or partial sum to the round's
remote side. What it cannot use is refused, named and counted by the link.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from edge_sdk.protocol import Kind, Message, ProtocolError
from edge_sdk.schema import check_meta

from ..strategies.base import Strategy
from .assignment import Assignments
from .delivery import Delivery
from .fleet import Fleet
from .intake import Intake
from .link import ServerLink
from .models import RunModels
from .phase import Phase
from .remote import RemoteRound
from .resketch import Resketch

__all__ = ["MessageRouter"]

log = logging.getLogger(__name__)


class MessageRouter:
    """The server's handler of device and aggregator messages (see the module docstring).

    ``hand_over(cid)``: a device placed (or known) while the server serves its models gets its model.
    """

    def __init__(self, *, strategy: Strategy, link: ServerLink, fleet: Fleet, intake: Intake, delivery: Delivery,
                 assignments: Assignments, resketch: Resketch, run_models: RunModels, remote: RemoteRound | None,
                 hand_over: Callable[[str], None]) -> None:
        self.strategy = strategy
        self.link = link
        self.fleet = fleet
        self.intake = intake
        self.delivery = delivery
        self.assignments = assignments
        self.resketch = resketch
        self.run_models = run_models
        self.remote = remote
        self.hand_over = hand_over
        #: Where the aggregators' messages come (their statuses go to the remote round too).
        self._aggregators = f"{link.topics.base}/aggregators/"

    def route(self, topic: str, msg: Message) -> None:
        """The link's handler: one device message, checked against the schema, to whom it concerns."""
        cid = msg.sender
        if self.remote is not None and (msg.kind in (Kind.RECEIPT, Kind.PARTIAL)
                                        or topic.startswith(self._aggregators)):
            self.remote.on_message(cid, msg)  # the transport took it only on that aggregator's topics, signed
            return
        msg = dataclasses.replace(msg, meta=check_meta(msg))  # every field a handler reads, checked
        if msg.kind == Kind.HELLO:
            self._on_hello(cid, msg)
            return
        state = self.fleet.clients.get(cid)
        if state is None and cid in self.fleet.pending:
            return  # registered, admitted once the models are chosen: its status adds nothing yet
        if state is None:
            self.link.reject("unknown-client", f"{msg.kind.name} from an unregistered client", cid)
            return
        state.last_seen = time.monotonic()
        intake = self.intake
        if msg.kind == Kind.STATUS:
            self.fleet.on_status(cid, state, msg.meta, intake.round)
            if "follow" in msg.meta:
                self.delivery.confirm(cid, msg.meta["follow"])
            if msg.meta.get("declined") == "sketch":
                intake.on_declined(cid)
            if "need" in msg.meta:
                self.delivery.send_whole(cid, msg.meta["need"], self.strategy.models, self.strategy.versions)
        elif msg.kind in (Kind.SKETCH, Kind.FEATURES):
            if not self.resketch.admits(cid, msg):
                return  # sent unasked, and this run does not follow drift: refused, counted
            sk = intake.on_summary(cid, msg)
            if intake.phase.trains and not self.strategy.is_clustered(cid):
                key = self.strategy.assign_late(cid, sk, state.info)
                self.assignments.assign(cid, key)
                self.hand_over(cid)
            elif intake.phase.trains:
                self.resketch.collect(cid, sk, msg)  # for the next round (a run that follows drift)
        elif msg.kind == Kind.UPDATE and intake.phase is Phase.PRETRAIN:
            intake.on_ae_update(cid, msg, state.info.n_samples)
        elif msg.kind == Kind.UPDATE:
            upd = intake.on_update(cid, msg)
            if upd is not None and upd.version is not None:
                self.delivery.note_held(cid, upd.model_key, upd.version)
        elif msg.kind == Kind.METRICS:
            intake.on_metrics(cid, msg.meta)
        elif msg.kind == Kind.REVEAL:
            intake.on_reveal(cid, msg)
        else:
            self.link.reject("kind", f"unexpected {msg.kind.name}", cid)

    def _on_hello(self, cid: str, msg: Message) -> None:
        """A device (re)announces itself: admit or refuse it now, or once the models are chosen."""
        m = msg.meta  # checked by the schema: n_samples in [1, 2**31), classes_present in [0, 65535]
        key = m.get("secure_key")
        if key is not None:
            if len(key) != 64 or any(ch not in "0123456789abcdef" for ch in key):
                raise ProtocolError("meta-field", "secure_key must be 64 lowercase hex digits")
            self.fleet.secure_keys[cid] = key
        if not self.run_models.chosen:
            if cid not in self.fleet.pending:
                log.info("client %s registered (%d samples, %s)", cid, m["n_samples"],
                         "x".join(map(str, m.get("input_shape", []))) or "shape not said")
            self.fleet.pending[cid] = m
            return
        # reconnected, it follows what it was told; restarted, every model; and it may have forgotten its model
        self.delivery.forget(cid)
        self.assignments.told.pop(cid, None)
        phase = self.intake.phase
        if not self.fleet.admit(cid, m, self.run_models, registering=phase.registering):
            return
        info = self.fleet.clients[cid].info
        if phase.trains and not self.strategy.is_clustered(cid):
            self.assignments.admit_late(cid, info)
        elif phase.trains:
            self.assignments.assign(cid, self.strategy.model_key_for(cid))
        if self.strategy.is_clustered(cid):  # placed now (no sketch needed), or known: its model, if serving
            self.hand_over(cid)
