"""The distance threshold of a Ward dendrogram, chosen by Bayesian optimisation of the CH index.

Every probe of ``skopt.gp_minimize`` is a cut of the same dendrogram, scored
exactly and cheaply from its :class:`~server_kit.clustering.dendrogram.CutProfile`
(the paper maximises CH; its public code minimises it). The partition chosen
is the best probe actually evaluated, not the surrogate's arg-max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from skopt import gp_minimize
from skopt.space import Real
from threadpoolctl import threadpool_limits

from .dendrogram import CutProfile

__all__ = ["ACQ_FUNCS", "BestCut", "bayes_search", "search_range"]

#: Acquisition functions of ``skopt.gp_minimize`` that the estimator accepts.
#: "LCB" on -CH is the paper's upper confidence bound on CH.
ACQ_FUNCS = ("EI", "LCB", "PI", "gp_hedge")


def search_range(profile: CutProfile,
                 threshold_range: tuple[float, float] | None) -> tuple[float, float] | None:
    """``(low, high)`` to search: the given range, else the dendrogram's own; None if there is none.

    By default ``low`` is the height of the first merge at which every cluster
    reaches the size rule (half the lowest positive height if that is 0) and
    ``high`` the top merge height.
    """
    if threshold_range is not None:
        low, high = (float(v) for v in threshold_range)
    else:
        first = np.flatnonzero(profile.allowed)
        if first.size == 0:
            return None
        h = profile.heights
        low, high = float(h[first[0] - 1]) if first[0] > 0 else 0.0, float(h[-1])
        if low <= 0:
            positive = h[h > 0]
            low = float(positive[0]) / 2
        if not low < high:
            return None
    return low, high


def bayes_search(profile: CutProfile, low: float, high: float, probes: list[dict[str, Any]], *,
                 n_calls: int, n_initial_points: int, acq_func: str, kappa: float,
                 random_state: np.random.RandomState) -> BestCut | None:
    """Bayesian optimisation of CH over thresholds in ``[low, high]``; the best admissible probe or None.

    Each probe is appended to ``probes`` (the estimator's ``search_``) as
    ``{"threshold", "ch", "n_clusters", "valid"}``, in order.
    """
    def objective(x: list[float]) -> float:
        t = float(x[0])
        m = profile.merges_at(t)
        k = int(profile.n_clusters[m])
        ok = bool(profile.allowed[m])
        ch = None if k < 2 else float(profile.ch[m])
        probes.append({"threshold": t, "ch": ch, "n_clusters": k, "valid": ok})
        # Inadmissible cuts score CH = 0, the worst any partition can get:
        # a huge constant would wreck the Gaussian process's scaling.
        return -ch if ok else 0.0

    # The GP works on 35 x 35 matrices: a multi-threaded BLAS only adds
    # thread hand-offs, which turn into long stalls on a busy machine.
    with threadpool_limits(limits=1, user_api="blas"):
        gp_minimize(
            objective,
            [Real(low, high, prior="log-uniform")],
            n_calls=n_calls,
            n_initial_points=n_initial_points,
            initial_point_generator="random",
            acq_func=acq_func,
            acq_optimizer="sampling",
            kappa=kappa,
            random_state=random_state,
        )
    best = None
    for probe in probes:
        if probe["valid"] and (best is None or probe["ch"] > best["ch"]):
            best = probe
    return None if best is None else BestCut(float(best["threshold"]), int(best["n_clusters"]), best["ch"])


@dataclass(frozen=True)
class BestCut:
    """The threshold search's best admissible cut: its threshold, its clusters, its CH."""

    threshold: float
    n_clusters: int
    ch: float | None
