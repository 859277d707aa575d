"""A run's first phase over MQTT: the devices say hello, the run's models are chosen, each device admitted or not.

The server announces the run and broadcasts ``hello`` (a device started
before it registers again); registration closes when ``min_clients`` devices
said hello, or at ``register_timeout_s`` with at least ``register_quorum`` of
them. Then the run's encoder and classifier are chosen from what the devices
can run (:func:`server_kit.admission.choose_models`) and each waiting device
is admitted or refused (:meth:`~.fleet.Fleet.admit`). A resumed run only asks
its known devices to say hello again (:func:`rejoin`).
"""

from __future__ import annotations

import logging
import math

from edge_sdk.install import install_hint
from edge_sdk.protocol.commands import Op

from .config import ServerConfig
from .wiring import RunParts

__all__ = ["register", "rejoin"]

log = logging.getLogger(__name__)


def register(parts: RunParts, config: ServerConfig, run_id: str) -> None:
    """Registration (see the module docstring); raises when too few devices came, or none of them can train."""
    link, fleet = parts.link, parts.fleet
    link.announce(run_id)
    link.broadcast(Op.HELLO)
    need = config.min_clients
    quorum = max(1, math.ceil(config.register_quorum * need))

    def count() -> int:
        return len(fleet.clients) + len(fleet.pending)

    ok = link.pump(lambda: count() >= need, config.register_timeout_s)
    link.pump(lambda: False, 0.5)  # let stragglers of the same start register too (short grace)
    if not ok:
        if count() < quorum:
            raise TimeoutError(
                f"only {count()} of the {need} clients needed registered within "
                f"{config.register_timeout_s:g} s (at least {quorum} to start: --register-quorum)")
        log.warning("registration deadline: starting with %d of the %d clients asked for (quorum %d)",
                    count(), need, quorum)
    admit_waiting(parts)
    if len(fleet.clients) < quorum:
        raise RuntimeError(f"only {len(fleet.clients)} client(s) admitted, {quorum} needed; refused: "
                           + "; ".join(f"{c}: {r}" for c, r in sorted(fleet.refused.items())))
    trainable = fleet.trainable()
    if not trainable:
        raise RuntimeError(f"none of the {len(fleet.clients)} admitted clients can train "
                           f"({'; '.join(f'{c}: {r}' for c, r in sorted(fleet.not_training.items()))}): "
                           f"install torch on the devices ({install_hint('train')})")
    log.info("registration closed: %d clients admitted (%d train)%s", len(fleet.clients), len(trainable),
             f", {len(fleet.refused)} refused" if fleet.refused else "")


def admit_waiting(parts: RunParts) -> None:
    """After registration: the models of the run (unless chosen), then each waiting device admitted or refused."""
    fleet, models = parts.fleet, parts.run_models
    if not models.chosen:
        from ..admission import choose_models

        enc, arch, how = choose_models(fleet.pending, models.encoder, models.architecture)
        models.use(enc, arch, how)
    for cid in sorted(fleet.pending):
        fleet.admit(cid, fleet.pending.pop(cid), models, registering=parts.intake.phase.registering)


def rejoin(parts: RunParts, config: ServerConfig, run_id: str) -> None:
    """A resumed run: announced, and its devices asked to say hello again (until ``min_clients`` are online)."""
    link, fleet = parts.link, parts.fleet
    link.announce(run_id)
    link.broadcast(Op.HELLO)
    link.pump(lambda: len(fleet.online_ids) >= min(config.min_clients, len(fleet.clients)), config.register_timeout_s)
    link.pump(lambda: False, 0.5)
