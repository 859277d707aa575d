"""The report's plots (matplotlib, Agg): accuracy per round, bytes per message kind, the threshold search."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_accuracy", "plot_bytes", "plot_threshold_search"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(path: str | Path, series: Mapping[str, Sequence[float | None]], *,
                  title: str = "Mean local test accuracy per round") -> Path:
    """One line per series (a method, or a cluster of a method), accuracy against round.

    A series whose name starts with two spaces is drawn dashed (a cluster
    under the method above it).
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, values in series.items():
        xs = [i for i, v in enumerate(values, start=1) if v is not None]
        ys = [v for v in values if v is not None]
        style = "--" if name.startswith("  ") else "-"
        ax.plot(xs, ys, style, marker="o", ms=3, label=name.strip())
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_bytes(path: str | Path, stats: Mapping[str, Mapping[str, Mapping[str, int]]],
               delivered: Mapping[str, int] | None = None, *,
               title: str = "Bytes on the wire at the server, per message kind") -> Path:
    """Bar chart of bytes per message kind (log scale).

    Parameters
    ----------
    path : str or Path
        The PNG to write.
    stats : mapping
        The transport's counters (``{"sent": {kind: {"bytes", ...}},
        "received": {...}}``).
    delivered : mapping, optional
        Kind -> bytes the devices downloaded (the run's ``delivered``): a
        third bar per kind beside the server's sent and received.
    title : str
        The plot's title.

    Returns
    -------
    Path
        ``path``.
    """
    plt = _plt()
    bars = {"sent by server": {k: v.get("bytes", 0) for k, v in stats.get("sent", {}).items()},
            "received by server": {k: v.get("bytes", 0) for k, v in stats.get("received", {}).items()}}
    if delivered is not None:
        bars["downloaded by devices"] = {k: int(v) for k, v in delivered.items()}
    kinds = sorted({k for d in bars.values() for k in d})
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(kinds) + 2), 4))
    for i, (label, values) in enumerate(bars.items()):
        xs = [x + (i - (len(bars) - 1) / 2) * width for x in range(len(kinds))]
        ys = [values.get(k, 0) for k in kinds]
        ax.bar(xs, ys, width=width, label=label)
        for x, v in zip(xs, ys):
            if v:
                ax.text(x, v, _human(v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(range(len(kinds))))
    ax.set_xticklabels(kinds)
    ax.set_yscale("log")
    ax.set_ylabel("bytes")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_threshold_search(strategy: Any, path: str | Path) -> Path | None:
    """The threshold search of a strategy's sketch clustering, if it has one.

    Parameters
    ----------
    strategy : object
        A strategy; its fitted ``model_`` is drawn with
        :func:`server_kit.clustering.plot_search` when it has a threshold
        search (``search_``).
    path : str or Path
        The PNG to write.

    Returns
    -------
    Path or None
        ``path``, or None (nothing written) when there is no search to draw.
    """
    model = getattr(strategy, "model_", None)
    if model is None or not hasattr(model, "search_"):
        return None
    from ..clustering import plot_search

    return plot_search(model, path)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
