"""The clustered-FL methods of the literature, one module each, on the interface of :mod:`server_kit.strategy`.

============================  ===============================================
module                        method
============================  ===============================================
:mod:`.ifca`                  IFCA (Ghosh et al.): K models, clients choose
:mod:`.ladd`                  LADD: K-means on per-class FFT amplitudes
:mod:`.update_clustered`      the base of methods that cluster from updates
:mod:`.ocfl`                  OCFL (Zuziak et al.): one-shot, HDBSCAN & co.
:mod:`.cfl`                   CFL (Sattler et al.): recursive bipartitions
:mod:`.briggs`                Briggs et al.: hierarchical clustering of updates
:mod:`.kmeans_weights`        K-means (K-medians) on the weights
:mod:`.flis`                  FLIS-HC and FLIS-DC: inference similarity
============================  ===============================================

Ours (``SketchClustered``) and FedAvg live in :mod:`server_kit.strategy`
with the interface. :data:`LAZY_STRATEGIES` is the registry of the methods
here (``--strategy`` name -> module and class), imported only when asked
for by :func:`server_kit.strategy.make_strategy`.
"""

from __future__ import annotations

#: ``--strategy`` name -> (module, class) of the methods in this package.
LAZY_STRATEGIES: dict[str, tuple[str, str]] = {
    "ifca": ("server_kit.strategies.ifca", "IFCA"),
    "ladd": ("server_kit.strategies.ladd", "LADD"),
    "ocfl": ("server_kit.strategies.ocfl", "OCFL"),
    "cfl": ("server_kit.strategies.cfl", "CFL"),
    "briggs": ("server_kit.strategies.briggs", "Briggs"),
    "kmeans-weights": ("server_kit.strategies.kmeans_weights", "KMeansWeights"),
    "flis-hc": ("server_kit.strategies.flis", "FLISHC"),
    "flis-dc": ("server_kit.strategies.flis", "FLISDC"),
}

__all__ = ["LAZY_STRATEGIES"]
