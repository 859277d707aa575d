"""Federated pre-training of the sketch autoencoder ("fedsketch-fedae"), then its encoder sent to every client.

FedAvg rounds of the autoencoder over the clients' images (model key "ae"),
then its encoder exported to ONNX and sent to every client (model key
"encoder", raw .onnx bytes, sha256 in meta). One phase of
:class:`~server_kit.drivers.orchestrator.Orchestrator` (``strategy.pretrain``).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edge_sdk.protocol import tensors_body
from edge_sdk.protocol.commands import Op

from .fleet import some_ids

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

__all__ = ["pretrain_ae"]

log = logging.getLogger(__name__)


def pretrain_ae(orch: Orchestrator) -> None:
    """Federated pre-training of the sketch autoencoder, then its encoder sent to every client."""
    from edge_sdk.trainer import initial_weights

    from ..pretrain import AEPretraining, export_encoder, sample_fraction
    from ..pretrain.settings import pretrain_config

    intake, models = orch.intake, orch.run_models
    t0 = time.monotonic()
    cfg = pretrain_config(orch.strategy.pretrain or {}, models.encoder)
    arch = cfg["architecture"]
    intake.phase = "pretrain"
    intake.ae = ae = AEPretraining(initial_weights(arch, orch.config.seed))
    for rnd in range(1, cfg["rounds"] + 1):
        tr = time.monotonic()
        chosen = sample_fraction(orch.trainable(), cfg["fraction"], orch.config.seed, rnd)
        intake.round, intake.tasked = rnd, set(chosen)
        ae.begin_round(rnd, chosen)
        intake.expect("ae", chosen, orch.fleet.online_ids)
        size, _ = orch.delivery.deliver({c: ["ae"] for c in chosen},
                                        {"ae": ({"key": "ae"}, tensors_body(ae.weights))}, "AE_MODEL")
        for cid in chosen:
            orch.link.command(cid, Op.TRAIN_AE, round=rnd, architecture=arch, epochs=cfg["epochs"], lr=cfg["lr"],
                              batch_size=cfg["batch_size"])
        orch.link.pump(lambda: ae.has_quorum(orch.config.round_quorum) or not intake.awaited.left,
                       orch.config.round_timeout_s)
        done = ae.close_round()
        if done.missing:
            log.warning("AE round %d closed without %d client(s): %s", rnd, len(done.missing),
                        some_ids(done.missing))
        orch.pretrain_history.append({"round": rnd, "tasked": len(chosen), "updates": len(done.clients),
                                      "missing": done.missing, "loss": done.loss, "model_bytes_delivered": size,
                                      "seconds": time.monotonic() - tr})
        log.info("AE pre-training round %d: %d/%d updates, MSE %s", rnd, len(done.clients), len(chosen), done.loss)
    weights = ae.weights
    intake.ae = None
    intake.tasked = set()
    intake.round = 0
    if orch.config.checkpoint_dir:
        out = Path(orch.config.checkpoint_dir) / "encoder"
    else:
        models.encoder_tmp = tempfile.TemporaryDirectory(prefix="fedsketch-fedae-")
        out = Path(models.encoder_tmp.name)
    name = f"fedae_{orch.config.federation}"
    exported = export_encoder(weights, arch, out, name=name,
                              metadata={"pretrain": {k: v for k, v in cfg.items()}})
    models.encoder_msg = ({"key": "encoder", "name": exported.name, "sha256": exported.sha256,
                           "entry": dict(exported.entry)}, exported.path.read_bytes())
    models.encoder = exported.name
    models.latent = int(exported.entry["latent_dim"])
    orch.delivery.send_encoder(orch.online(), models.encoder_msg)
    intake.phase = "register"
    orch.timings["pretrain_s"] = time.monotonic() - t0
    log.info("federated encoder %s (%d bytes, latent %d) sent", exported.name, exported.nbytes, models.latent)
