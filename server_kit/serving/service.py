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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edge_sdk.client import KEEPS_MODELS
from edge_sdk.keep_offer import KeepOffer

from .export import ExportedRun, export_models, exported_accuracy
from .handover import hand_over, keep_all
from .offers import final_accuracy_per_model, model_offers

__all__ = ["ModelService"]

log = logging.getLogger(__name__)


class ModelService:
    """The trained models in use (see the module docstring).

    Parameters
    ----------
    run : Any
        The orchestrator whose models these are: its strategy, config, link,
        fleet, delivery, assignments, intake, architecture and run id are read
        when needed (a resumed run changes some of them).
    write_state : callable
        ``write_state(folder, round)``: the server's state for an export's ``server-state``.
    ask_again_s : float
        A device served less than this long ago is not served again (its hello on connecting and its
        hello on the run's announcement ask once).
    """

    def __init__(self, run: Any, *, write_state: Callable[[Path, int], None], ask_again_s: float) -> None:
        self.run = run
        self.write_state = write_state
        self.ask_again_s = float(ask_again_s)
        #: Each model's figures at the end of the run (sha256, accuracy...): what the keep commands and the
        #: export give (:func:`~server_kit.serving.offers.model_offers`).
        self.offers: dict[str, KeepOffer] = {}
        #: Devices served while serving (cold start), with the model keys sent (several: the device chooses).
        self.served: dict[str, list[str]] = {}
        self._served_at: dict[str, float] = {}

    def _infos(self) -> dict[str, Any]:
        return {c: st.info for c, st in self.run.clients.items()}

    def export(self, folder: str | Path, *, rnd: int | None = None) -> ExportedRun | None:
        """Export the run's models to ``folder`` (:mod:`.export`); None if it failed (logged).

        ``rnd``: a checkpoint's round (its models have no final evaluation yet); None: the finished run's.
        """
        run = self.run
        final = rnd is None
        last = run.config.rounds if final else int(rnd)
        offers = self.offers if final and self.offers else model_offers(run.strategy, rnd=last,
                                                                        clients=self._infos())
        try:
            return export_models(folder, run.strategy, offers, run_id=run.run_id, architecture=str(run.architecture),
                                 rnd=last, final=final, write_state=lambda d: self.write_state(d, last))
        except (OSError, ValueError) as e:  # a full disk must not end the run: the last export stays
            log.error("models not exported to %s: %s", folder, e)
            return None

    def keep(self, final: Mapping[str, Any]) -> None:
        """The end of the run: every assigned online device that keeps models told to keep its own."""
        run = self.run
        strategy, clients = run.strategy, run.clients
        self.offers = model_offers(strategy, rnd=run.config.rounds, clients=self._infos(),
                                   accuracy=final_accuracy_per_model(final))
        keys = {c: strategy.model_key_for(c) for c in run.fleet.online()
                if strategy.is_clustered(c) and KEEPS_MODELS in clients[c].info.capabilities}
        if not keys:
            log.info("keep: no device of the run keeps its model (none said %r in its hello)", KEEPS_MODELS)
            return
        keep_all(strategy, self.offers, keys=keys, told=run.assignments.told,
                 evaluated=set(final.get("per_client") or ()), link=run.link, delivery=run.delivery,
                 rnd=run.intake.round, run_id=run.run_id, architecture=run.architecture)

    def hand_over(self, cid: str) -> None:
        """While serving: the device just placed (or known) is sent its model and told to keep it."""
        run = self.run
        if time.monotonic() - self._served_at.get(cid, -self.ask_again_s) < self.ask_again_s:
            log.debug("%s said hello again: its model is on its way", cid)  # a hello on connecting, one on the
            return  # announcement: one model each
        self._served_at[cid] = time.monotonic()
        self.served[cid] = hand_over(cid, run.strategy, self.offers, link=run.link, delivery=run.delivery,
                                     rnd=run.intake.round, run_id=run.run_id, architecture=run.architecture)

    def offers_from_export(self, last: int) -> None:
        """Serving from an export (nothing trained): the offers of its models, with the accuracies it recorded."""
        run = self.run
        self.offers = model_offers(run.strategy, rnd=last, clients=self._infos(),
                                   accuracy=exported_accuracy(Path(run.config.checkpoint_dir or ".").parent))
