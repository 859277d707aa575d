"""The ``keep`` commands: every device keeps its model at the end of a run; a device that arrives later gets one.

:func:`keep_all` ends a run: each assigned online device that did not get
its model's last version in the final evaluation is sent it, then one
broadcast ``keep`` names every model with its sha256 and the server's
accuracy (each device keeps the model it was told); a device told no model
key, or another one (IFCA's choices), gets its own ``keep`` naming its key.

:func:`hand_over` is the cold start, while the server serves its models: the
device just placed (its sketch to the nearest centroid, or the global model)
is sent its model and a ``keep`` naming it; with a strategy whose devices
choose their model (IFCA), every model and a ``keep`` that asks it to choose
the one of lowest loss on a local batch, as in training.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from edge_sdk.models.keep_offer import KeepOffer
from edge_sdk.protocol.commands import Op

if TYPE_CHECKING:  # the drivers call this module: their types only
    from ..drivers.delivery import Delivery
    from ..drivers.link import ServerLink
    from ..strategies.base import Strategy

__all__ = ["hand_over", "keep_all"]

log = logging.getLogger(__name__)


def _fields(strategy: Strategy, offers: Mapping[str, KeepOffer], keys: Collection[str], *, rnd: int,
            run_id: str | None, architecture: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"round": rnd, "strategy": strategy.name,
                           "models": {k: offers[k].to_wire() for k in sorted(keys)}}
    if run_id:
        out["run"] = run_id
    if architecture:
        out["architecture"] = architecture
    return out


def keep_all(strategy: Strategy, offers: Mapping[str, KeepOffer], *, keys: Mapping[str, str],
             told: Mapping[str, str], evaluated: Collection[str], link: ServerLink, delivery: Delivery, rnd: int,
             run_id: str | None, architecture: str | None) -> dict[str, int]:
    """Tell every device of ``keys`` (device -> its model key) to keep its model; see the module docstring.

    ``told``: the key each device was last told in an assign; ``evaluated``: the devices that got their
    model's last version in the final evaluation. Returns how many were sent models, and the commands.
    """
    missing = {c: [k] for c, k in keys.items() if c not in evaluated}
    if missing:
        delivery.deliver_models(missing, strategy.models, strategy.versions)
    fields = _fields(strategy, offers, set(keys.values()), rnd=rnd, run_id=run_id, architecture=architecture)
    link.broadcast(Op.KEEP, **fields)
    own = sorted(c for c, k in keys.items() if told.get(c) != k)
    for cid in own:
        link.command(cid, Op.KEEP, **{**fields, "models": {keys[cid]: offers[keys[cid]].to_wire()},
                                      "model_key": keys[cid]})
    log.info("keep: %d device(s) told to keep their model (%d model(s); %d sent their model first, %d told "
             "their key)", len(keys), len(set(keys.values())), len(missing), len(own))
    return {"devices": len(keys), "sent_models": len(missing), "own_commands": len(own)}


def hand_over(cid: str, strategy: Strategy, offers: Mapping[str, KeepOffer], *, link: ServerLink,
              delivery: Delivery, rnd: int, run_id: str | None, architecture: str | None) -> list[str]:
    """Send a device arriving while the server serves its model(s) and a ``keep``; returns the keys sent."""
    choose = strategy.capabilities.devices_choose_model
    keys = sorted(offers) if choose else [strategy.model_key_for(cid)]
    delivery.deliver_models({cid: keys}, strategy.models, strategy.versions)
    fields = _fields(strategy, offers, keys, rnd=rnd, run_id=run_id, architecture=architecture)
    if choose:
        fields["choose"] = True
    else:
        fields["model_key"] = keys[0]
    link.command(cid, Op.KEEP, **fields)
    log.info("served %s model %s", cid, "of " + ", ".join(keys) + " (the device chooses)" if choose else keys[0])
    return keys
