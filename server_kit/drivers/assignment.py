"""Which model each device is told (the ``assign`` command), the clustered ones and those that come late.

After the clustering, :meth:`Assignments.announce` tells every online device
its model; with automatic delivery and a clustering, the same command tells
it to follow only that model's topic (see :mod:`server_kit.drivers.delivery`).
A device that comes late (or was not clustered) is placed by the strategy's
``assign_late``, from its sketch when the strategy clusters sketches: if the
server has none yet, it asks for one (sending the federated encoder first,
when there is one).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from edge_sdk.protocol.commands import Op

from ..strategies.base import ClientInfo, Strategy
from ..strategies.clustered import ClusteredFedAvg
from .config import ServerConfig
from .delivery import Delivery
from .fleet import Fleet
from .intake import Intake
from .link import ServerLink
from .models import RunModels

__all__ = ["Assignments"]

log = logging.getLogger(__name__)

#: A late device's hello within this many seconds of its sketch request does not ask again (a device says
#: hello on every connection, and may say it twice as it connects).
ASK_AGAIN_S = 10.0


class Assignments:
    """Tells each device its model, and asks a late one for its sketch (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        Who is in which cluster (``clusters``, ``model_key_for``, ``assign_late``).
    config : ServerConfig
        The run's settings (model delivery, what a sketch request asks).
    link, fleet, intake, delivery, models
        The driver's parts this one speaks through and reads.
    """

    def __init__(self, strategy: Strategy, config: ServerConfig, link: ServerLink, fleet: Fleet, intake: Intake,
                 delivery: Delivery, models: RunModels) -> None:
        self.strategy = strategy
        self.config = config
        self.link = link
        self.fleet = fleet
        self.intake = intake
        self.delivery = delivery
        self.models = models
        #: The model key each device was last told in an assign (what a broadcast evaluate makes it evaluate).
        self.told: dict[str, str] = {}
        #: When each late device was last asked for its sketch (``time.monotonic()``).
        self.asked: dict[str, float] = {}

    def narrows(self) -> bool:
        """Whether assigned devices follow only their own cluster's topic (auto delivery, a clustering)."""
        return (self.config.model_delivery == "auto" and isinstance(self.strategy, ClusteredFedAvg)
                and bool(self.strategy.assignment))

    def assign(self, cid: str, key: str) -> None:
        """Tell a device its model; with :meth:`narrows`, also that it follows only that model's topic."""
        meta: dict[str, Any] = {"model_key": key}
        if self.narrows():
            follow = self.delivery.narrow(cid, key, cid in self.fleet.online_ids)
            if follow is not None:
                meta["follow"] = follow
        self.told[cid] = key
        self.link.command(cid, Op.ASSIGN, **meta)

    def announce(self) -> None:
        """After the clustering: every online device told its model (an unclustered one placed as a late one)."""
        for cid in self.fleet.online():
            if self.strategy.is_clustered(cid):
                self.assign(cid, self.strategy.model_key_for(cid))
            else:
                self.admit_late(cid, self.fleet.clients[cid].info)

    def admit_late(self, cid: str, info: ClientInfo) -> None:
        """Place a device the clustering did not see: from its sketch (asked for, if need be), or without."""
        if self.strategy.capabilities.needs_sketches:
            if cid in self.intake.sketches:
                key = self.strategy.assign_late(cid, self.intake.sketches[cid], info)
                self.assign(cid, key)
            elif time.monotonic() - self.asked.get(cid, -ASK_AGAIN_S) < ASK_AGAIN_S:
                log.debug("late client %s said hello again: its sketch request is under way", cid)
            else:
                log.info("late client %s: asking for its sketch", cid)
                self.asked[cid] = time.monotonic()
                self.ask_sketch(cid)
        else:
            key = self.strategy.assign_late(cid, None, info)
            self.assign(cid, key)

    def sketch_request(self) -> dict[str, Any]:
        """What a ``sketch`` command asks: the encoder, the classes, the flip probability, the summary."""
        encoder = {"encoder": self.models.encoder} if self.models.encoder else {}  # LADD's spectra need none
        return {**encoder, "num_classes": self.config.num_classes, "flip_prob": self.config.flip_prob,
                "summary": self.strategy.capabilities.summary_kind, "params": dict(self.strategy.capabilities.summary_params)}

    def ask_sketch(self, cid: str) -> None:
        """Ask one device for its sketch."""
        if self.models.encoder_msg is not None and self.intake.phase.trains:
            # a late client has not got the federated encoder yet
            self.delivery.send_encoder([cid], self.models.encoder_msg)
        self.link.command(cid, Op.SKETCH, **self.sketch_request())
