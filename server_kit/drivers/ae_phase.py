"""Federated pre-training of the sketch autoencoder ("fedsketch-fedae"), then its encoder sent to every client.

FedAvg rounds of the autoencoder over the clients' images (model key "ae"),
then its encoder exported to ONNX and sent to every client (model key
"encoder", raw .onnx bytes, sha256 in meta). One phase of
:class:`~server_kit.drivers.orchestrator.Orchestrator` (``strategy.capabilities.pretrain``).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_sdk.protocol import tensors_body
from edge_sdk.protocol.commands import Op

from ..ids import some_ids
from .config import ServerConfig
from .delivery import Delivery
from .fleet import Fleet
from .intake import Intake
from .link import ServerLink
from .models import RunModels
from .phase import Phase

__all__ = ["PretrainResult", "pretrain_ae"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainResult:
    """The autoencoder pre-training of a run: one record per round, and its seconds in all."""

    history: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def pretrain_ae(pretrain: Mapping[str, Any], config: ServerConfig, *, link: ServerLink, fleet: Fleet,
                intake: Intake, delivery: Delivery, models: RunModels) -> PretrainResult:
    """Federated pre-training of the sketch autoencoder, then its encoder sent to every client.

    ``pretrain`` is the strategy's pre-training table (``strategy.capabilities.pretrain``);
    the encoder becomes ``models.encoder`` (and ``models.encoder_msg``, what a
    late device is sent).
    """
    from edge_sdk.training.trainer import initial_weights

    from ..pretrain import AEPretraining, export_encoder, sample_fraction
    from ..pretrain.settings import pretrain_config

    t0 = time.monotonic()
    cfg = pretrain_config(pretrain, models.encoder)
    arch = cfg["architecture"]
    intake.run.enter(Phase.PRETRAIN)
    intake.ae = ae = AEPretraining(initial_weights(arch, config.seed))
    history: list[dict[str, Any]] = []
    for rnd in range(1, cfg["rounds"] + 1):
        tr = time.monotonic()
        chosen = sample_fraction(fleet.trainable(), cfg["fraction"], config.seed, rnd)
        intake.run.begin_round(rnd)
        intake.tasked = set(chosen)
        ae.begin_round(rnd, chosen)
        awaited = intake.expect("ae", chosen, fleet.online_ids)
        size, _ = delivery.deliver({c: ["ae"] for c in chosen},
                                   {"ae": ({"key": "ae"}, tensors_body(ae.weights))}, "AE_MODEL")
        for cid in chosen:
            link.command(cid, Op.TRAIN_AE, round=rnd, architecture=arch, epochs=cfg["epochs"], lr=cfg["lr"],
                         batch_size=cfg["batch_size"])
        link.pump(lambda a=awaited: ae.has_quorum(config.report_goal) or not a.left, config.round_timeout_s)
        done = ae.close_round()
        if done.missing:
            log.warning("AE round %d closed without %d client(s): %s", rnd, len(done.missing),
                        some_ids(done.missing))
        history.append({"round": rnd, "tasked": len(chosen), "updates": len(done.clients),
                        "missing": done.missing, "loss": done.loss, "model_bytes_delivered": size,
                        "seconds": time.monotonic() - tr})
        log.info("AE pre-training round %d: %d/%d updates, MSE %s", rnd, len(done.clients), len(chosen), done.loss)
    weights = ae.weights
    intake.ae = None
    intake.tasked = set()
    if config.checkpoint_dir:
        out = Path(config.checkpoint_dir) / "encoder"
    else:
        models.encoder_tmp = tempfile.TemporaryDirectory(prefix="fedsketch-fedae-")
        out = Path(models.encoder_tmp.name)
    name = f"fedae_{config.federation}"
    exported = export_encoder(weights, arch, out, name=name,
                              metadata={"pretrain": {k: v for k, v in cfg.items()}})
    models.encoder_msg = ({"key": "encoder", "name": exported.name, "sha256": exported.sha256,
                           "entry": dict(exported.entry)}, exported.path.read_bytes())
    models.encoder = exported.name
    models.latent = int(exported.entry["latent_dim"])
    delivery.send_encoder(fleet.online(), models.encoder_msg)
    log.info("federated encoder %s (%d bytes, latent %d) sent", exported.name, exported.nbytes, models.latent)
    return PretrainResult(history, time.monotonic() - t0)
