"""A run's own record (its id, its rounds, its timings) and its state in a checkpoint folder, both ways.

:class:`RunRecord` is what the :class:`~.orchestrator.Orchestrator` writes as
the run goes; :func:`save_run` writes it with the parts' state (the
strategy's models, the devices, their sketches and pace, the fresh sketches
of a run that follows drift) through :func:`~.checkpoint.write_checkpoint`;
:func:`restore_run` reads a checkpoint back into the parts of a fresh process
(a killed server resumed, or one serving an export's models).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..strategies.base import Strategy
from .checkpoint import read_checkpoint, read_encoder, write_checkpoint
from .config import ServerConfig
from .link import new_run_id
from .wiring import RunParts

__all__ = ["RunRecord", "restore_run", "save_run"]

log = logging.getLogger(__name__)


@dataclass
class RunRecord:
    """What a run has done so far, as ``results.json`` and the checkpoint keep it."""

    #: The run's id, announced on the server's status topic (a resumed run keeps its checkpoint's).
    run_id: str = field(default_factory=new_run_id)
    #: Each round's record (:meth:`server_kit.rounds.training.RoundReport.to_dict`).
    history: list[dict[str, Any]] = field(default_factory=list)
    #: Seconds per phase ("register_s", "sketch_collect_s", "clustering_s", "training_s"...).
    timings: dict[str, float] = field(default_factory=dict)
    #: The autoencoder pre-training's rounds (a strategy that pre-trains its encoder).
    pretrain_history: list[dict[str, Any]] = field(default_factory=list)


def save_run(folder: str | Path, rnd: int, parts: RunParts, strategy: Strategy, config: ServerConfig,
             record: RunRecord) -> None:
    """Write the run's state after round ``rnd`` to ``folder`` (JSON + safetensors)."""
    models = parts.run_models
    write_checkpoint(folder, rnd, strategy, history=record.history, timings=record.timings,
                     clients={c: s.info for c, s in parts.fleet.clients.items()}, sketches=parts.intake.sketches,
                     config=config, encoder=models.encoder, architecture=models.architecture,
                     latent_dim=models.latent, pretrain_history=record.pretrain_history,
                     fresh=parts.resketch.pending(), pace=parts.pace.state(), run_id=record.run_id)


def restore_run(parts: RunParts, strategy: Strategy, config: ServerConfig, record: RunRecord) -> int:
    """Read ``config.checkpoint_dir`` back into ``parts``, ``strategy`` and ``record``; returns its last round."""
    ck = read_checkpoint(config.checkpoint_dir or "")
    models = parts.run_models
    arch = ck.architecture or models.architecture
    if not models.chosen or arch != models.architecture:
        models.use(ck.encoder or models.encoder, arch, "from the checkpoint")
    strategy.setup(list(ck.clients.values()), models.template)
    strategy.load_state(ck.strategy, ck.tensors)
    parts.fleet.restore(ck.clients)
    parts.pace.load_state(ck.pace)
    for cid, reason in parts.pace.benched.items():
        parts.fleet.bench(cid, reason)
    parts.intake.sketches = ck.sketches
    parts.resketch.restore(ck.fresh)
    record.history = ck.history
    record.timings = ck.timings
    record.run_id = ck.run_id or record.run_id
    record.pretrain_history = ck.pretrain_history
    models.encoder = ck.encoder or models.encoder
    if ck.latent_dim is not None:
        models.latent = ck.latent_dim
    encoder_msg = read_encoder(ck.path, models.encoder)  # the federated encoder, for late clients
    if encoder_msg is not None:
        models.encoder_msg = encoder_msg
    log.info("resumed from %s after round %d (%d clients known)", ck.path, ck.round, len(parts.fleet.clients))
    return ck.round
