"""A run's trained models in use, on the server's side: exported, kept by the devices, handed to newcomers.

:class:`ModelService` is the orchestrator's part for the models once trained:

- :meth:`ModelService.export`: the run's models as a folder (:mod:`.export`),
  at every checkpoint and at the end;
- :meth:`ModelService.keep`: at the end of the run, every assigned online
  device that keeps models is told to keep its own (:func:`.handover.keep_all`);
- :meth:`ModelService.hand_over`: while the server serves its models
  (after the run, or instead of it from an export), a device that says hello
  and is placed is sent its model (:func:`.handover.hand_over`), once per
  hello burst.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_sdk.client import KEEPS_MODELS
from edge_sdk.models.keep_offer import KeepOffer

from ..strategies.base import Strategy
from .export import ExportedRun, export_models, exported_accuracy
from .handover import hand_over, keep_all
from .offers import model_offers

if TYPE_CHECKING:  # the orchestrator's parts (drivers import this module: no import back at run time)
    from ..drivers.assignment import Assignments
    from ..drivers.config import ServerConfig
    from ..drivers.delivery import Delivery
    from ..drivers.fleet import Fleet
    from ..drivers.intake import Intake
    from ..drivers.link import ServerLink
    from ..drivers.models import RunModels
    from ..drivers.records import FinalEvaluation

__all__ = ["ModelService"]

log = logging.getLogger(__name__)


class ModelService:
    """The trained models in use (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        The run's strategy: its models, clusters and state.
    config : ServerConfig
        The run's settings (its rounds, its checkpoint folder).
    link, fleet, delivery, assignments, intake, run_models
        The orchestrator's parts: where commands go, the devices, the model
        delivery, which model each device was told, the phase and round, the
        architecture.
    run_id : callable
        The run's id now (a resumed run takes its checkpoint's).
    write_state : callable
        ``write_state(folder, round)``: the server's state for an export's ``server-state``.
    ask_again_s : float
        A device served less than this long ago is not served again (its hello on connecting and its
        hello on the run's announcement ask once).
    """

    def __init__(self, *, strategy: Strategy, config: ServerConfig, link: ServerLink, fleet: Fleet,
                 delivery: Delivery, assignments: Assignments, intake: Intake, run_models: RunModels,
                 run_id: Callable[[], str],
                 write_state: Callable[[Path, int], None], ask_again_s: float) -> None:
        self.strategy = strategy
        self.config = config
        self.link = link
        self.fleet = fleet
        self.delivery = delivery
        self.assignments = assignments
        self.intake = intake
        self.run_models = run_models
        self.run_id = run_id
        self.write_state = write_state
        self.ask_again_s = float(ask_again_s)
        #: Each model's figures at the end of the run (sha256, accuracy...): what the keep commands and the
        #: export give (:func:`~server_kit.serving.offers.model_offers`).
        self.offers: dict[str, KeepOffer] = {}
        #: Devices served while serving (cold start), with the model keys sent (several: the device chooses).
        self.served: dict[str, list[str]] = {}
        self._served_at: dict[str, float] = {}

    def _infos(self) -> dict[str, Any]:
        return {c: st.info for c, st in self.fleet.clients.items()}

    def export(self, folder: str | Path, *, rnd: int | None = None) -> ExportedRun | None:
        """Export the run's models to ``folder`` (:mod:`.export`); None if it failed (logged).

        ``rnd``: a checkpoint's round (its models have no final evaluation yet); None: the finished run's.
        """
        final = rnd is None
        last = self.config.rounds if final else int(rnd)
        offers = self.offers if final and self.offers else model_offers(self.strategy, rnd=last,
                                                                        clients=self._infos())
        try:
            return export_models(folder, self.strategy, offers, run_id=self.run_id(), architecture=str(self.run_models.architecture),
                                 rnd=last, final=final, write_state=lambda d: self.write_state(d, last))
        except (OSError, ValueError) as e:  # a full disk must not end the run: the last export stays
            log.error("models not exported to %s: %s", folder, e)
            return None

    def keep(self, final: FinalEvaluation) -> None:
        """The end of the run: every assigned online device that keeps models told to keep its own."""
        strategy, clients = self.strategy, self.fleet.clients
        self.offers = model_offers(strategy, rnd=self.config.rounds, clients=self._infos(),
                                   accuracy=final.accuracy_per_model())
        keys = {c: strategy.model_key_for(c) for c in self.fleet.online()
                if strategy.is_clustered(c) and KEEPS_MODELS in clients[c].info.capabilities}
        if not keys:
            log.info("keep: no device of the run keeps its model (none said %r in its hello)", KEEPS_MODELS)
            return
        keep_all(strategy, self.offers, keys=keys, told=self.assignments.told,
                 evaluated=set(final.per_client), link=self.link, delivery=self.delivery,
                 rnd=self.intake.round, run_id=self.run_id(), architecture=self.run_models.architecture)

    def hand_over(self, cid: str) -> None:
        """While serving: the device just placed (or known) is sent its model and told to keep it."""
        if time.monotonic() - self._served_at.get(cid, -self.ask_again_s) < self.ask_again_s:
            log.debug("%s said hello again: its model is on its way", cid)  # a hello on connecting, one on the
            return  # announcement: one model each
        self._served_at[cid] = time.monotonic()
        self.served[cid] = hand_over(cid, self.strategy, self.offers, link=self.link, delivery=self.delivery,
                                     rnd=self.intake.round, run_id=self.run_id(), architecture=self.run_models.architecture)

    def offers_from_export(self, last: int) -> None:
        """Serving from an export (nothing trained): the offers of its models, with the accuracies it recorded."""
        self.offers = model_offers(self.strategy, rnd=last, clients=self._infos(),
                                   accuracy=exported_accuracy(Path(self.config.checkpoint_dir or ".").parent))
