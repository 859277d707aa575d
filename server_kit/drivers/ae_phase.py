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

import numpy as np

from edge_sdk.protocol import tensors_body

from .fleet import some_ids

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

__all__ = ["pretrain_ae"]

log = logging.getLogger(__name__)


def pretrain_ae(orch: Orchestrator) -> None:
    """Federated pre-training of the sketch autoencoder, then its encoder sent to every client."""
    from edge_sdk.trainer import initial_weights, state_spec

    from ..aggregate import StreamingFedAvg
    from ..pretrain import export_encoder
    from ..pretrain_settings import pretrain_config

    intake, models = orch.intake, orch.run_models
    t0 = time.monotonic()
    cfg = pretrain_config(orch.strategy.pretrain or {}, models.encoder)
    arch = cfg["architecture"]
    intake.phase = "pretrain"
    weights = initial_weights(arch, orch.config.seed)
    intake.ae_spec = state_spec(weights)
    for rnd in range(1, cfg["rounds"] + 1):
        tr = time.monotonic()
        intake.round = rnd
        intake.ae_updates = {}
        pool = orch.trainable()
        m = max(1, int(np.ceil(cfg["fraction"] * len(pool))))
        chosen = pool if m >= len(pool) else sorted(
            np.random.default_rng([orch.config.seed, rnd, 7919]).choice(pool, size=m, replace=False).tolist())
        intake.tasked = set(chosen)
        intake.expect("ae", chosen, orch.fleet.online_ids)
        size, _ = orch.delivery.deliver({c: ["ae"] for c in chosen},
                                        {"ae": ({"key": "ae"}, tensors_body(weights))}, "AE_MODEL")
        for cid in chosen:
            orch.link.command(cid, "train_ae", round=rnd, architecture=arch, epochs=cfg["epochs"], lr=cfg["lr"],
                              batch_size=cfg["batch_size"])
        need = max(1, int(np.ceil(orch.config.round_quorum * len(chosen))))

        def done(need: int = need) -> bool:
            return len(intake.ae_updates) >= need or not intake.awaited.left

        orch.link.pump(done, orch.config.round_timeout_s)
        got = {c: intake.ae_updates[c] for c in sorted(intake.ae_updates)}
        missing = sorted(intake.tasked - set(got))
        if missing:
            log.warning("AE round %d closed without %d client(s): %s", rnd, len(missing), some_ids(missing))
        if got:
            agg = StreamingFedAvg(weights)
            for w, n, _ in got.values():
                agg.add(w, n)
            weights = agg.result()
        n_tot = sum(n for _, n, _ in got.values())
        loss = sum(loss * n for _, n, loss in got.values()) / n_tot if n_tot else None
        orch.pretrain_history.append({"round": rnd, "tasked": len(chosen), "updates": len(got),
                                      "missing": missing, "loss": loss, "model_bytes_delivered": size,
                                      "seconds": time.monotonic() - tr})
        log.info("AE pre-training round %d: %d/%d updates, MSE %s", rnd, len(got), len(chosen), loss)
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
