"""FedSketch server kit: the server side (clustering, strategies, drivers, brokers, data, reports).

This package builds on :mod:`edge_sdk`. Importing it stays cheap: every
public name below is imported from its module on first use (PEP 562), so
``import server_kit`` loads neither torch nor scikit-learn::

    from server_kit import Orchestrator, ServerConfig, SketchClustered
    from server_kit import SketchClustering, make_strategy, Simulator
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ClientInfo": "strategies.base",
    "ClusteredFedAvg": "strategies.clustered",
    "EmbeddedBroker": "broker",
    "EmulatedFleet": "emulate",
    "FedAvg": "strategies.fedavg",
    "FedCRefCoordinator": "fedcref.mqtt",
    "FedCRefServer": "fedcref.server",
    "MosquittoBroker": "broker",
    "Orchestrator": "drivers.orchestrator",
    "STRATEGIES": "strategies",
    "ServerConfig": "drivers.config",
    "Simulator": "drivers.simulate",
    "SketchClustered": "strategies.fedsketch",
    "SketchClustering": "clustering",
    "Strategy": "strategies.base",
    "clustering_scores": "metrics",
    "make_strategy": "strategies",
    "plot_search": "clustering",
    "run_fedcref": "fedcref.run",
    "write_report": "report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'server_kit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
