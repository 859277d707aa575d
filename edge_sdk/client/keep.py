"""A device's answer to a ``keep`` command: check the model against the server's sha256, then keep it or not.

:func:`keep_from_command` is what the ``keep`` handler (:func:`edge_sdk.client.commands.keep`)
does, with what it needs passed in: the command's checked fields, a way to
wait for a model, the device's worker (its test split, its IFCA choice) and
its :class:`~edge_sdk.models.keeping.ModelKeeper` (None: no model folder). The
model is kept only if the device's copy has the sha256 the server offers,
bit for bit the server's export; the keep policy then decides
(:meth:`~edge_sdk.models.keeping.ModelKeeper.offer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..models.keep_offer import parse_offers
from ..models.keeping import KeepDecision, ModelKeeper
from ..models.model_folder import ModelEntry, weights_sha256
from ..training.evaluation import classifier_io, evaluate

__all__ = ["KeepOutcome", "keep_from_command", "own_accuracy"]

log = logging.getLogger("edge_sdk.client")

#: Samples of the local batch on which a device chooses among offered models (IFCA's choice, as in training).
CHOICE_BATCH = 64


@dataclass(frozen=True)
class KeepOutcome:
    """What a ``keep`` command came to on this device."""

    #: The model key it was about (None: the command did not concern this device).
    key: str | None
    #: What the keeper did (None: nothing offered to it: no model folder, or a refused model).
    decision: KeepDecision | None = None
    #: Why the model was refused (its sha256 differs from the server's), or None.
    refused: str | None = None

    @property
    def has_model(self) -> bool:
        """Whether the device keeps a model after this command (the new one or the one before)."""
        return self.decision is not None and self.decision.current is not None


def own_accuracy(worker: Any) -> Callable[[str, Mapping[str, np.ndarray]], tuple[float, int] | None]:
    """The evaluator of the keep policy: accuracy on the worker's own test split, with ONNX Runtime as the
    owner's application runs it (None when the device has no test split of its own)."""
    def run(architecture: str, weights: Mapping[str, np.ndarray]) -> tuple[float, int] | None:
        if not getattr(worker, "has_test", False):
            return None
        r = evaluate(architecture, weights, worker.x_test, worker.y_test, force_onnx=True)
        return r.accuracy, r.n

    return run


def keep_from_command(m: Mapping[str, Any], *, assigned: str | None, run_id: str | None,
                      wait_model: Callable[[str, int], Any], worker: Any,
                      keeper: ModelKeeper | None) -> KeepOutcome:
    """Do what the ``keep`` command ``m`` (checked by the schema) asks; see the module docstring.

    Raises
    ------
    ProtocolError
        ``meta-field`` for an offer that breaks its rules (:func:`~edge_sdk.models.keep_offer.parse_offers`).
    TimeoutError
        When the model does not arrive in time.
    """
    offers = parse_offers(m["models"])
    r = m["round"]
    run = m.get("run") or run_id
    if keeper is None:  # nothing to wait for: the server sends the last model only to devices that keep it
        log.info("the models of run %s are not kept: this device has no model folder (--model-dir)", run)
        return KeepOutcome(None)
    key = m.get("model_key") or assigned
    if m["choose"] and offers:  # IFCA: the lowest loss on one local batch, as in training
        held = {k: wait_model(k, r).weights for k in sorted(offers)}
        key = worker.select(held, CHOICE_BATCH)
        log.info("chose model %s of %d offered (lowest loss on a local batch)", key, len(offers))
    if key is None or key not in offers:
        log.debug("keep (round %d): model %s not offered here, ignored", r, key)
        return KeepOutcome(None)
    offer = offers[key]
    weights = wait_model(key, r).weights
    sha = weights_sha256(weights)
    if sha != offer.sha256:
        return KeepOutcome(key, refused=f"model {key} of round {r}: its weights have sha256 {sha[:16]}..., the "
                                        f"server's export {offer.sha256[:16]}...: not kept")
    arch = m.get("architecture") or worker.architecture
    entry = ModelEntry(key=key, architecture=arch, **classifier_io(arch), run=run, strategy=m.get("strategy"),
                       cluster=offer.cluster, round=offer.round, version=offer.version, members=offer.members,
                       samples=offer.samples, server_accuracy=offer.accuracy, server_evaluated=offer.evaluated)
    decision = keeper.offer(entry, weights, own_accuracy(worker))
    (log.info if decision.kept_new or decision.current is not None else log.warning)("%s", decision.reason)
    return KeepOutcome(key, decision)

