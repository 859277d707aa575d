"""What ``fedsketch-server`` prints and writes when a run is over: the one-line JSON summary and the report.

:func:`print_summary` prints the run's summary (the same figures, under the
same names, as ``results.json``'s); with a report folder it writes the
report and the models' export there first, and names the page.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["print_summary"]


def print_summary(run: Any, orch: Any, report_dir: str | None, *, target_accuracy: float, truth: Any,
                  want_results: bool = False) -> dict[str, Any] | None:
    """Print the summary of ``run`` (a :class:`~server_kit.drivers.result.RunResult`); with ``report_dir``, write
    the report and the export of ``orch``'s models first. Returns what ``results.json`` holds when it was built
    (a report folder, or ``want_results``: the live page's final state), else None."""
    from ..metrics import final_accuracy
    from . import accuracy_per_round, build_results, clustering_against_truth, write_report

    result = run.to_dict()
    summary: dict[str, Any] = {
        "strategy": run.strategy, "final_accuracy": _round(final_accuracy(accuracy_per_round(result))),
        "final_evaluation": _round(run.final["accuracy"]), "clusters": len(set(run.assignment.values())),
        "rounds": len(run.history)}
    if run.benched:
        summary["benched"] = sorted(run.benched)
    results = None
    if report_dir or want_results:
        results = build_results(result, target_accuracy=target_accuracy, truth=truth)
    if report_dir and results is not None:
        exported = orch.export_models(Path(report_dir) / "models")
        if exported is not None:
            results["models"] = {"folder": "models", "manifest": "models/models.json",
                                 "models": exported.manifest["models"]}
            summary["models"] = str(exported.link)
        files = write_report(report_dir, results, strategy=orch.strategy)
        print(f"report: {files['report.html']}")
    if truth is not None:
        summary["ari"] = _round(results["clustering"]["ari"] if results is not None else
                                clustering_against_truth(run.assignment, truth)["ari"])
    print(json.dumps(summary))
    return results


def _round(v: float | None) -> float | None:
    return None if v is None else round(float(v), 4)
