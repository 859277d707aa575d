"""FedSketch inside Flower: the device side (the ``flower`` extra: :func:`edge_sdk.install.install_hint`).

:func:`client_app` / :func:`add_fedsketch` build the ``ClientApp`` a Flower
node runs; :mod:`edge_sdk.flower.records` is the message layout it shares
with the server adapter :mod:`server_kit.flower`. Nothing else of
``edge_sdk`` imports Flower.
"""

from __future__ import annotations

from ..install import install_hint

try:
    import flwr  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a venv without flwr
    raise ImportError(f"edge_sdk.flower needs Flower: {install_hint('flower')}") from e

from .client_app import EVALUATE, TRAIN, NodeData, TrainFn, add_fedsketch, client_app

__all__ = ["EVALUATE", "TRAIN", "NodeData", "TrainFn", "add_fedsketch", "client_app"]
