"""Every federated-learning method of the server, one module each, and the registry that finds them by name.

============================  ===============================================
module                        method
============================  ===============================================
:mod:`.base`                  the :class:`~.base.Strategy` interface and the
                              pieces every method shares
:mod:`.fedavg`                FedAvg (McMahan et al.), the worked example
:mod:`.clustered`             FedAvg per cluster, the base of every method
                              that ends with one model per cluster
:mod:`.fedsketch`             ours: clustering once from client sketches
                              (``fedsketch``, ``fedsketch-fedae``)
:mod:`.ifca`                  IFCA (Ghosh et al.): K models, clients choose
:mod:`.ladd`                  LADD: K-means on per-class FFT amplitudes
:mod:`.update_clustered`      the base of methods that cluster from updates
:mod:`.ocfl`                  OCFL (Zuziak et al.): one-shot, HDBSCAN & co.
:mod:`.cfl`                   CFL (Sattler et al.): recursive bipartitions
:mod:`.briggs`                Briggs et al.: hierarchical clustering of updates
:mod:`.kmeans_weights`        K-means (K-medians) on the weights
:mod:`.flis`                  FLIS-HC and FLIS-DC: inference similarity
============================  ===============================================

:data:`REGISTRY` is the one table of the ``--strategy`` names: name ->
module and class. A strategy's module is imported only when its class is
asked for (:func:`strategy_class`, :func:`make_strategy`), so importing this
package loads no method.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["LAZY_STRATEGIES", "REGISTRY", "STRATEGIES", "make_strategy", "strategy_class", "strategy_names"]

#: ``--strategy`` name -> (module, class) of every method.
REGISTRY: dict[str, tuple[str, str]] = {
    "fedavg": ("server_kit.strategies.fedavg", "FedAvg"),
    "fedsketch": ("server_kit.strategies.fedsketch", "SketchClustered"),
    "fedsketch-fedae": ("server_kit.strategies.fedsketch", "FedAESketchClustered"),
    "ifca": ("server_kit.strategies.ifca", "IFCA"),
    "ladd": ("server_kit.strategies.ladd", "LADD"),
    "ocfl": ("server_kit.strategies.ocfl", "OCFL"),
    "cfl": ("server_kit.strategies.cfl", "CFL"),
    "briggs": ("server_kit.strategies.briggs", "Briggs"),
    "kmeans-weights": ("server_kit.strategies.kmeans_weights", "KMeansWeights"),
    "flis-hc": ("server_kit.strategies.flis", "FLISHC"),
    "flis-dc": ("server_kit.strategies.flis", "FLISDC"),
}

#: The names of FedAvg and ours; the other names of :data:`REGISTRY` are the literature's methods.
OURS_AND_FEDAVG = ("fedavg", "fedsketch", "fedsketch-fedae")

#: The literature's methods only: a view of :data:`REGISTRY`, kept for callers of this older name.
LAZY_STRATEGIES: dict[str, tuple[str, str]] = {
    name: where for name, where in REGISTRY.items() if name not in OURS_AND_FEDAVG}


def strategy_names() -> list[str]:
    """Every strategy a user can pick."""
    return sorted(REGISTRY)


def strategy_class(name: str) -> type[Strategy]:
    """The class of strategy ``name``, its module imported now; a ValueError names the choices."""
    if name not in REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of {strategy_names()}")
    module, attr = REGISTRY[name]
    return getattr(importlib.import_module(module), attr)


def make_strategy(name: str, **kw: Any) -> Strategy:
    """A strategy by name (``fedavg``, ``fedsketch``, ``ifca``, ``ladd``, ...).

    ``architecture`` is context the drivers always know: it is passed only to
    strategies that take it (IFCA builds its K models from it). Any other
    keyword a strategy does not take is refused by the strategy itself.
    """
    cls = strategy_class(name)
    if "architecture" in kw and not _passes_through(cls, "architecture"):
        kw.pop("architecture")
    return cls(**kw)


def _passes_through(cls: type, name: str) -> bool:
    """Whether ``name`` is a parameter somewhere along the class's ``__init__`` chain."""
    import inspect

    return any(name in inspect.signature(c.__init__).parameters
               for c in cls.__mro__ if "__init__" in vars(c))


def __getattr__(name: str) -> Any:
    # STRATEGIES imports the modules of FedAvg and ours, so it is built on first use only
    if name == "STRATEGIES":
        value = {n: strategy_class(n) for n in OURS_AND_FEDAVG}
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
