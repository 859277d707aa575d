"""``--plot FILE``: a PNG of every stage's time and the training epochs (horizontal bars, log scale).

matplotlib is optional on a device: it is imported here, by :func:`write_plot`
only; :func:`plot_missing` says what to install before anything is timed.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from .report import STAGE_ROWS
from .results import BenchResult

__all__ = ["plot_missing", "write_plot"]

_COLOURS = ("tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:cyan", "tab:olive")


def plot_missing() -> Optional[str]:
    """None when matplotlib is installed; otherwise the one line that says what to install."""
    if importlib.util.find_spec("matplotlib") is None:
        return ("--plot needs matplotlib, which is not installed: pip install matplotlib "
                "(the table, --json and the last JSON line need nothing more)")
    return None


def _bars(result: BenchResult) -> tuple[list[str], list[float], list[str], dict[int, str]]:
    """Labels, milliseconds, colours, and the ratio text of each epoch bar (by bar index)."""
    labels, values, colours, notes = [], [], [], {}
    encoders = list(dict.fromkeys(s.encoder for s in result.stages))
    for s in result.stages:
        if s.seconds is not None and s.seconds > 0:
            labels.append(f"{s.encoder}: {STAGE_ROWS.get(s.stage, s.stage)}")
            values.append(s.seconds * 1e3)
            colours.append(_COLOURS[encoders.index(s.encoder) % len(_COLOURS)])
    ratios = {r.architecture: r for r in result.ratios}
    for t in result.training:
        if t.seconds is None:
            continue
        r = ratios.get(t.architecture)
        if r is not None:
            paper = f", paper {r.paper:g}x" if r.paper is not None else ""
            notes[len(labels)] = f" {r.ratio:,.0f}x the {r.encoder} sketch{paper}"
        labels.append(f"{t.label} epoch ({t.samples} samples)")
        values.append(t.seconds * 1e3)
        colours.append("tab:red")
    return labels, values, colours, notes


def write_plot(result: BenchResult, path: str) -> None:
    """Write the PNG: one bar per stage and encoder, one per epoch annotated with its Figure 6 ratio."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    labels, values, colours, notes = _bars(result)
    fig = Figure(figsize=(10, 0.3 * max(len(labels), 1) + 1.8))
    ax = fig.subplots()
    ys = list(range(len(labels)))
    ax.barh(ys, values, color=colours)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log scale)")
    for i, text in notes.items():  # inside the epoch's bar, at its end: the longest bars, never cut by the frame
        ax.annotate(text, (values[i], ys[i]), xytext=(-4, 0), textcoords="offset points", ha="right", va="center",
                    fontsize=8, color="white", fontweight="bold")
    if values:
        ax.set_xlim(min(values) / 2, max(values) * 3)
    m = result.machine
    ax.set_title(f"fedsketch bench: {m.cpu}, {m.cores} cores, kernel {m.kernel}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
