"""Every FedSketch strategy inside Flower (the ``flower`` extra: :func:`edge_sdk.install.install_hint`).

* :class:`FlowerStrategy` wraps any :class:`server_kit.strategies.base.Strategy`
  as a Flower strategy (Message API) for a ``ServerApp`` you write;
* :func:`server_app` is a ready ``ServerApp`` configured by the run config
  (:class:`FlowerRunConfig`);
* the nodes run :func:`edge_sdk.flower.client_app`.

Nothing else of ``server_kit`` imports Flower.
"""

from __future__ import annotations

from edge_sdk.install import install_hint

try:
    import flwr  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a venv without flwr
    raise ImportError(f"server_kit.flower needs Flower: {install_hint('flower')}") from e

from .server_app import FlowerRunConfig, build_strategy, run, server_app
from .strategy import FlowerStrategy, check_carry
from .wire import message_bytes

__all__ = ["FlowerRunConfig", "FlowerStrategy", "build_strategy", "check_carry", "message_bytes", "run",
           "server_app"]
