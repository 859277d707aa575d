"""The report figure of a fitted :class:`~server_kit.clustering.sketch.SketchClustering`: CH against threshold."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from scipy.cluster.hierarchy import fcluster

from .dendrogram import cut_profile

if TYPE_CHECKING:
    from .sketch import SketchClustering

__all__ = ["plot_search"]


def plot_search(model: SketchClustering, path: str | Path) -> Path:
    """Draw CH against threshold for every probe and the chosen threshold; save to ``path``.

    Admissible probes are dots (random ones hollow, guided ones filled),
    inadmissible ones grey crosses (at CH 0 when the cut is one cluster); the
    line is CH of every admissible cut of the dendrogram over the searched
    range. Uses the Agg canvas directly, so the global matplotlib backend is
    left alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    if not hasattr(model, "search_"):
        raise ValueError("the model is not fitted yet: call fit first")
    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    probes = model.search_
    n_init = int(model.n_initial_points)
    if model.threshold_range_ is not None and model.linkage_.shape[0] > 0:
        prof = cut_profile(model.linkage_, model.min_cluster_size)
        low, high = model.threshold_range_
        edges = np.concatenate(
            ([low], prof.heights[(prof.heights > low) & (prof.heights < high)], [high])
        )
        ys = [
            prof.ch[m] if prof.allowed[m] else np.nan
            for m in (prof.merges_at(t) for t in edges[:-1])
        ]
        ax.stairs(ys, edges, baseline=None, color="0.6", lw=0.8, label="every cut")
    for guided in (False, True):
        pts = [
            (s["threshold"], s["ch"])
            for i, s in enumerate(probes)
            if s["valid"] and (i >= n_init) == guided
        ]
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(
                xs, ys, s=28, zorder=3,
                facecolors="C0" if guided else "none", edgecolors="C0",
                label="guided probe" if guided else "random probe",
            )  # fmt: skip
    bad = [(s["threshold"], s["ch"] or 0.0) for s in probes if not s["valid"]]
    if bad:
        xs, ys = zip(*bad)
        ax.scatter(xs, ys, marker="x", color="0.5", zorder=3, label="inadmissible probe")
    top_k = int(fcluster(model.linkage_, model.threshold_, criterion="distance").max()) if model.linkage_.size else 1
    label = f"chosen, k = {top_k}"
    if top_k != model.n_clusters_:
        label += f" (refined to k = {model.n_clusters_})"
    ax.axvline(model.threshold_, color="C3", ls="--", label=label)
    if probes:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("distance threshold (Ward merge height)")
    ax.set_ylabel("Calinski-Harabasz index")
    title = f"{model.labels_.size} clients x {model.n_bits_} bits"
    if getattr(model, "sample_", None) is not None:
        title += f" (dendrogram of a sample of {model.sample_.size})"
    if model.null_pvalue_ is not None:
        title += f"; permutation test p = {model.null_pvalue_:.3g}"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out
