"""The content of ``results.json``: a run's result plus the derived measures, each defined.

:func:`build_results` adds to what :meth:`server_kit.drivers.orchestrator.Orchestrator.run`
returns the accuracy series (:func:`accuracy_per_round`,
:func:`accuracy_per_cluster_per_round`), the final accuracy, the bytes, the
refusals and, with the true groups (:func:`load_truth`), the clustering's
scores (:func:`clustering_against_truth`); :data:`DEFINITIONS` says what
each means. :func:`write_json` writes it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "DEFINITIONS",
    "FINAL_ROUNDS",
    "accuracy_per_cluster_per_round",
    "accuracy_per_round",
    "build_results",
    "clustering_against_truth",
    "load_truth",
    "json_text",
    "number_or_none",
    "write_json",
]

#: Rounds averaged by ``final_accuracy`` (the paper's final accuracy).
FINAL_ROUNDS = 5

#: What each derived field of ``results.json`` means (written into it as ``"definitions"``).
DEFINITIONS: dict[str, str] = {
    "accuracy_per_round": (
        "entry r-1 is the accuracy after round r: the mean local test accuracy of the round's models (the global "
        "model, or each client's cluster model), measured by the clients on their own test data before training "
        "in round r+1; the last entry is the final evaluation's mean; null where no client reported one"),
    "accuracy_per_cluster_per_round": (
        "model key -> a list like accuracy_per_round, the mean over the clients that measured that model (those "
        "whose update of round r+1 was for it; the last entry over the clients evaluating it in the final "
        "evaluation); null where none did"),
    "final_accuracy": (
        f"mean of the last {FINAL_ROUNDS} non-null entries of accuracy_per_round (the paper's final accuracy)"),
    "final_evaluation": (
        "the evaluation after the last round: every online assigned client (with --eval-fraction F < 1, a seeded "
        "sample of F of them holding at least one client per cluster) evaluates its model on its own test data; "
        "mean over the clients that reported, per_cluster the mean over each model's clients; asked: the "
        "clients asked, evaluated: those that reported, eval_fraction: F (when the run records them)"),
    "rounds_to_target": "first round r (1-based) whose accuracy_per_round entry reaches target_accuracy; null if none",
    "bytes": (
        "sent_by_server and received_by_server: MQTT payload bytes and messages at the server per message kind "
        "(chunks counted under the kind they carry); downloaded_by_devices: bytes of models (and encoders) per "
        "kind as the broker delivers them to the devices (a model broadcast on a cluster topic counts once per "
        "device that receives it)"),
    "refused": "clients the server refused, client id -> reason",
    "dropped": "clients the server dropped during the run, client id -> reason",
    "benched": "clients not tasked again (nor waited for in the final evaluation) after --bench-after rounds in "
               "a row without a usable update: refused, or silent while online; client id -> reason",
    "devices": "each device's own benchmark (fedsketch bench, sent with its hello by fedsketch-client --bench), "
               "client id -> cpu (as the device names it), sketch_ms (its whole sketch), epoch_ms (one local epoch "
               "of its architecture), epoch_over_sketch (the paper's Figure 6 ratio), cores, mem_mb: those it measured",
    "privacy": (
        "what the run gave away. sketch: one sketch's local DP epsilon (randomised response over its bits: per bit "
        "ln((1-P)/P), per image the bits of one class vector, per device every bit) and each device's total over "
        "the sketches it sent; dp: each cluster's (epsilon, delta) from the accountant of its DP-FedAvg rounds; "
        "secure: the cluster rounds summed by secure aggregation"),
    "run_id": "the run's id, as the server announced it on its status topic (devices in service mode join each run "
              "once)",
    "rounds_closing": "per round: the devices selected (spares included), reported (valid updates), stragglers "
                      "(dropped at the close, their late updates refused), refused (client id -> reason), why the "
                      "round closed (all-answered, goal, deadline, cap) and when (close_s), when every cluster had "
                      "its report goal (goal_s)",
    "clustering": (
        "the final assignment against the true groups (--truth): adjusted Rand index, adjusted mutual "
        "information, completeness and homogeneity (sklearn.metrics) over the clients on both sides; clients "
        "missing from either side are listed and not scored"),
}


def write_json(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as indented JSON (numpy scalars and arrays, sets and tuples as JSON values).

    Parameters
    ----------
    path : str or Path
        The file; its folder is created.
    data : mapping
        What to write.

    Returns
    -------
    Path
        ``path``.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json_text(data))
    return p


def json_text(data: Mapping[str, Any]) -> str:
    """``data`` as ``results.json`` writes it: indented JSON, numpy values, sets and tuples as JSON values."""
    return json.dumps(data, indent=2, default=_default)


def _default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


# -- derived measures ---------------------------------------------------------


def accuracy_per_round(result: Mapping[str, Any]) -> list[float | None]:
    """Accuracy after each round of an orchestrator run (see ``DEFINITIONS["accuracy_per_round"]``).

    Parameters
    ----------
    result : mapping
        What :meth:`server_kit.drivers.orchestrator.Orchestrator.run` returns
        (``history`` and ``final`` are read).

    Returns
    -------
    list of float or None
        One entry per round: round r+1's ``acc_before``, the last the final
        evaluation's mean.
    """
    history = result.get("history", [])
    final = result.get("final") or {}
    return [number_or_none(h.get("acc_before")) for h in history[1:]] + [number_or_none(final.get("accuracy"))]


def accuracy_per_cluster_per_round(result: Mapping[str, Any]) -> dict[str, list[float | None]]:
    """Accuracy after each round per model key (see ``DEFINITIONS["accuracy_per_cluster_per_round"]``).

    Parameters
    ----------
    result : mapping
        What :meth:`server_kit.drivers.orchestrator.Orchestrator.run` returns: each
        round's ``acc_before_per_model`` and the final ``per_model`` are read.

    Returns
    -------
    dict
        Model key -> one entry per round (None where no client measured it).
    """
    history = result.get("history", [])
    final_per_model = (result.get("final") or {}).get("per_model") or {}
    rows = [h.get("acc_before_per_model") or {} for h in history[1:]] + [final_per_model]
    keys = sorted({k for row in rows for k in row})
    return {k: [number_or_none(row.get(k)) for row in rows] for k in keys}


def number_or_none(v: Any) -> float | None:
    """``v`` as a float, None staying None (a measure a round may lack)."""
    return None if v is None else float(v)


def load_truth(path: str | Path) -> dict[str, Any]:
    """Read a truth file: a JSON object client id -> true group (``fedsketch-data split`` writes one).

    Raises
    ------
    ValueError
        When it cannot be read, is not such an object, or a group is not a
        string or an integer.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--truth {path}: cannot read it: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--truth {path}: expected a JSON object client id -> group, got {type(data).__name__}")
    bad = sorted(c for c, g in data.items() if isinstance(g, bool) or not isinstance(g, (str, int)))
    if bad:
        raise ValueError(f"--truth {path}: groups must be strings or integers; not so for {bad[:5]}")
    return data


def clustering_against_truth(assignment: Mapping[str, Any], truth: Mapping[str, Any]) -> dict[str, Any]:
    """Scores of a clustering against the true groups of the clients on both sides.

    Parameters
    ----------
    assignment : mapping
        Client id -> cluster (the run's ``assignment``).
    truth : mapping
        Client id -> true group.

    Returns
    -------
    dict
        ``ari``, ``ami``, ``completeness``, ``homogeneity`` (None when no
        client is on both sides), ``clients_scored``, and the sorted lists
        ``missing_from_truth`` (assigned, no true group) and
        ``missing_from_assignment`` (a true group, not assigned).
    """
    from sklearn.metrics import (
        adjusted_mutual_info_score,
        adjusted_rand_score,
        completeness_score,
        homogeneity_score,
    )

    both = sorted(set(assignment) & set(truth))
    out: dict[str, Any] = {"ari": None, "ami": None, "completeness": None, "homogeneity": None}
    if both:
        t = [str(truth[c]) for c in both]
        p = [str(assignment[c]) for c in both]
        out = {"ari": float(adjusted_rand_score(t, p)), "ami": float(adjusted_mutual_info_score(t, p)),
               "completeness": float(completeness_score(t, p)), "homogeneity": float(homogeneity_score(t, p))}
    missing_truth = sorted(set(assignment) - set(truth))
    missing_assign = sorted(set(truth) - set(assignment))
    if missing_truth or missing_assign:
        log.warning("clustering scored on %d clients: %d assigned without a true group, %d true groups unassigned",
                    len(both), len(missing_truth), len(missing_assign))
    return {**out, "clients_scored": len(both), "missing_from_truth": missing_truth,
            "missing_from_assignment": missing_assign}


def build_results(result: Mapping[str, Any], *, target_accuracy: float = 0.8,
                  truth: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The content of ``results.json``: the run's result plus the derived measures, defined.

    Parameters
    ----------
    result : mapping
        What :meth:`server_kit.drivers.orchestrator.Orchestrator.run` returns.
    target_accuracy : float, default 0.8
        The accuracy ``rounds_to_target`` waits for.
    truth : mapping, optional
        Client id -> true group: adds ``clustering``
        (:func:`clustering_against_truth`).

    Returns
    -------
    dict
        ``result``'s keys, then ``clients``, ``rounds``,
        ``accuracy_per_round``, ``accuracy_per_cluster_per_round``,
        ``final_accuracy``, ``final_evaluation``, ``target_accuracy``,
        ``rounds_to_target``, ``bytes``, ``refused`` and ``dropped`` (when
        the result has them), ``clustering`` (with ``truth``) and
        ``definitions`` (of those present).
    """
    from ..metrics import final_accuracy, rounds_to_target

    accs = accuracy_per_round(result)
    final = result.get("final") or {}
    transport = result.get("transport") or {}
    out: dict[str, Any] = dict(result)
    out.update({
        "clients": len(result.get("assignment") or {}),
        "rounds": len(result.get("history") or []),
        "accuracy_per_round": accs,
        "accuracy_per_cluster_per_round": accuracy_per_cluster_per_round(result),
        "final_accuracy": final_accuracy(accs, FINAL_ROUNDS),
        "final_evaluation": {"mean": number_or_none(final.get("accuracy")),
                             "per_cluster": {k: float(v) for k, v in (final.get("per_model") or {}).items()},
                             **{k: final[k] for k in ("asked", "evaluated", "eval_fraction") if k in final}},
        "target_accuracy": float(target_accuracy),
        "rounds_to_target": rounds_to_target(accs, target_accuracy),
        "bytes": {"sent_by_server": dict(transport.get("sent") or {}),
                  "received_by_server": dict(transport.get("received") or {}),
                  "downloaded_by_devices": dict(result.get("delivered") or {})},
    })
    defined = ["accuracy_per_round", "accuracy_per_cluster_per_round", "final_accuracy", "final_evaluation",
               "rounds_to_target", "bytes"]
    history = result.get("history") or []
    if history and "selected" in history[0]:
        out["rounds_closing"] = [{k: rec.get(k) for k in ("round", "selected", "spares", "reported", "stragglers",
                                                          "refused", "close", "close_s", "goal_s")}
                                 for rec in history]
        defined.append("rounds_closing")
    for key in ("refused", "dropped", "benched"):
        if key in result:
            out[key] = dict(result[key] or {})
            defined.append(key)
    for key in ("devices", "run_id", "privacy"):
        if result.get(key):
            defined.append(key)
    if truth is not None:
        out["clustering"] = clustering_against_truth(result.get("assignment") or {}, truth)
        defined.append("clustering")
    out["definitions"] = {k: DEFINITIONS[k] for k in defined}
    return out
