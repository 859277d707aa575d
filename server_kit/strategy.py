"""Moved to :mod:`server_kit.strategies` and :mod:`server_kit.pretrain.settings`; this path keeps working for one release.

The interface is in :mod:`server_kit.strategies.base`, FedAvg in
:mod:`~server_kit.strategies.fedavg`, FedAvg per cluster in
:mod:`~server_kit.strategies.clustered`, ours in
:mod:`~server_kit.strategies.fedsketch` and the registry
(``make_strategy``) in :mod:`server_kit.strategies`.
"""

import warnings

# the old module's whole surface, and the names other modules imported from it
from .pretrain.settings import PRETRAIN_DEFAULTS, pretrain_config
from .strategies import LAZY_STRATEGIES, STRATEGIES, make_strategy, strategy_names  # noqa: F401
from .strategies.base import ClientInfo, Strategy, Weights, add_updates, copy_weights  # noqa: F401
from .strategies.clustered import ClusteredFedAvg
from .strategies.fedavg import FedAvg
from .strategies.fedsketch import FedAESketchClustered, SketchClustered

__all__ = [
    "ClientInfo",
    "ClusteredFedAvg",
    "FedAESketchClustered",
    "FedAvg",
    "PRETRAIN_DEFAULTS",
    "SketchClustered",
    "Strategy",
    "STRATEGIES",
    "make_strategy",
    "pretrain_config",
]

warnings.warn("server_kit.strategy has moved to server_kit.strategies", DeprecationWarning, stacklevel=2)
