"""Run reports: a folder with the results as JSON and the plots a person would look at.

:func:`write_report` writes a server run's report folder from what
:meth:`server_kit.drivers.orchestrator.Orchestrator.run` returns:

* ``results.json``: the run's result plus the derived measures of
  :func:`build_results`, each defined in its ``"definitions"`` entry;
* ``accuracy.png``: mean accuracy per round and one line per cluster model;
* ``threshold_search.png``: the sketch clustering's threshold search (only
  for strategies that cluster sketches with a threshold search);
* ``bytes.png``: bytes per message kind the server sent and received, beside
  what the devices downloaded;
* ``report.html``: one self-contained page (inline CSS, no script) with the
  summary, the plots (by relative file name), and the tables.

The pieces (:func:`accuracy_per_round`, :func:`plot_accuracy`,
:func:`plot_bytes`, :func:`plot_threshold_search`, ...) serve the demo and
the benchmarks too. They live in three modules, one job each:
:mod:`~server_kit.report.results` (``results.json``: the derived measures and
their definitions), :mod:`~server_kit.report.plots` (the PNGs) and
:mod:`~server_kit.report.page` (``report.html``); this module writes the
folder.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .page import write_html
from .plots import plot_accuracy, plot_bytes, plot_threshold_search
from .results import (
    DEFINITIONS,
    FINAL_ROUNDS,  # noqa: F401 (server_kit.report.FINAL_ROUNDS keeps working)
    accuracy_per_cluster_per_round,
    accuracy_per_round,
    build_results,
    clustering_against_truth,
    load_truth,
    write_json,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFINITIONS",
    "accuracy_per_cluster_per_round",
    "accuracy_per_round",
    "build_results",
    "clustering_against_truth",
    "load_truth",
    "plot_accuracy",
    "plot_bytes",
    "plot_threshold_search",
    "progress_bar",
    "write_html",
    "write_json",
    "write_report",
]


def write_report(report_dir: str | Path, results: Mapping[str, Any], *, strategy: Any = None) -> dict[str, Path]:
    """Write a server run's report folder (see the module docstring).

    Parameters
    ----------
    report_dir : str or Path
        The folder (created).
    results : mapping
        What :func:`build_results` returns for the run.
    strategy : object, optional
        The run's strategy: its threshold search is drawn when it has one
        (:func:`plot_threshold_search`).

    Returns
    -------
    dict
        File name -> path of every file written: ``results.json``,
        ``accuracy.png``, ``bytes.png``, ``report.html``, and
        ``threshold_search.png`` when drawn.

    Raises
    ------
    ValueError
        When ``results`` did not come from :func:`build_results`.
    """
    if "definitions" not in results:
        raise ValueError("write_report takes what build_results returns (it has no 'definitions')")
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {"results.json": write_json(out / "results.json", results)}
    series: dict[str, Sequence[float | None]] = {"mean": results["accuracy_per_round"]}
    series.update({f"  {k}": v for k, v in results["accuracy_per_cluster_per_round"].items()})
    files["accuracy.png"] = plot_accuracy(out / "accuracy.png", series)
    search = plot_threshold_search(strategy, out / "threshold_search.png")
    if search is not None:
        files["threshold_search.png"] = search
    files["bytes.png"] = plot_bytes(out / "bytes.png", results.get("transport") or {},
                                    results.get("delivered") or {},
                                    title="Bytes per message kind: the server's, and what the devices downloaded")
    files["report.html"] = write_html(out / "report.html", results, list(files))
    log.info("report written to %s", out)
    return files


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar of ``total`` steps (or None when disabled or tqdm is missing)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a server dependency
        return None
    return tqdm(total=total, desc=desc, leave=False)
