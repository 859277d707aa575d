"""The settings of the federated autoencoder pre-training (paper, Section V): defaults and their check."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["PRETRAIN_DEFAULTS", "pretrain_config"]

#: Settings of the federated autoencoder pre-training (paper, Section V) when not given.
PRETRAIN_DEFAULTS: dict[str, Any] = {"architecture": None, "rounds": 3, "epochs": 2, "lr": 1e-3,
                                     "batch_size": 32, "fraction": 1.0}


def pretrain_config(pretrain: Mapping[str, Any], encoder: Any = None) -> dict[str, Any]:
    """Validated federated AE pre-training settings, defaults filled in.

    ``architecture`` (an autoencoder key of :mod:`edge_sdk.training.nets`) may be left
    out: it is then that of ``encoder`` (an artifact name of the installed
    manifest, or an :class:`edge_sdk.encoder.OnnxEncoder`), the encoder the
    server would otherwise sketch with. Without either it stays None.
    """
    unknown = sorted(set(pretrain) - set(PRETRAIN_DEFAULTS))
    if unknown:
        raise ValueError(f"pretrain: unknown keys {unknown}; known: {sorted(PRETRAIN_DEFAULTS)}")
    cfg = {**PRETRAIN_DEFAULTS, **dict(pretrain)}
    for key in ("rounds", "epochs", "batch_size"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"pretrain {key} must be a positive integer, got {v!r}")
        cfg[key] = int(v)
    lr = cfg["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"pretrain lr must be a positive finite number, got {lr!r}")
    cfg["lr"] = float(lr)
    if not isinstance(cfg["fraction"], (int, float)) or not 0.0 < float(cfg["fraction"]) <= 1.0:
        raise ValueError(f"pretrain fraction must be in (0, 1], got {cfg['fraction']!r}")
    cfg["fraction"] = float(cfg["fraction"])
    if cfg["architecture"] is None and encoder is not None:
        spec = getattr(encoder, "spec", None)
        if spec is None:
            from edge_sdk.models.artifacts import load_manifest

            spec = load_manifest().get(str(encoder))
        arch = (spec.extra or {}).get("architecture") if spec is not None else None
        if not arch:
            raise ValueError(f"pretrain: no architecture given and encoder {encoder!r} names none")
        cfg["architecture"] = str(arch)
    if cfg["architecture"] is not None and not isinstance(cfg["architecture"], str):
        raise ValueError(f"pretrain architecture must be a string, got {cfg['architecture']!r}")
    return cfg

