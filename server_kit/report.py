"""Run reports: a folder with the results as JSON and the plots a person would look at.

:func:`write_report` writes a server run's report folder from what
:meth:`server_kit.orchestrator.Orchestrator.run` returns:

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
the benchmarks too.
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
    "clustering": (
        "the final assignment against the true groups (--truth): adjusted Rand index, adjusted mutual "
        "information, completeness and homogeneity (sklearn.metrics) over the clients on both sides; clients "
        "missing from either side are listed and not scored"),
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    p.write_text(json.dumps(data, indent=2, default=_default))
    return p


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
        What :meth:`server_kit.orchestrator.Orchestrator.run` returns
        (``history`` and ``final`` are read).

    Returns
    -------
    list of float or None
        One entry per round: round r+1's ``acc_before``, the last the final
        evaluation's mean.
    """
    history = result.get("history", [])
    final = result.get("final") or {}
    return [_num(h.get("acc_before")) for h in history[1:]] + [_num(final.get("accuracy"))]


def accuracy_per_cluster_per_round(result: Mapping[str, Any]) -> dict[str, list[float | None]]:
    """Accuracy after each round per model key (see ``DEFINITIONS["accuracy_per_cluster_per_round"]``).

    Parameters
    ----------
    result : mapping
        What :meth:`server_kit.orchestrator.Orchestrator.run` returns: each
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
    return {k: [_num(row.get(k)) for row in rows] for k in keys}


def _num(v: Any) -> float | None:
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
        What :meth:`server_kit.orchestrator.Orchestrator.run` returns.
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
    from .metrics import final_accuracy, rounds_to_target

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
        "final_evaluation": {"mean": _num(final.get("accuracy")),
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
    for key in ("refused", "dropped"):
        if key in result:
            out[key] = dict(result[key] or {})
            defined.append(key)
    if truth is not None:
        out["clustering"] = clustering_against_truth(result.get("assignment") or {}, truth)
        defined.append("clustering")
    out["definitions"] = {k: DEFINITIONS[k] for k in defined}
    return out


# -- plots -----------------------------------------------------------------------


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
    from .clustering import plot_search

    return plot_search(model, path)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# -- the page --------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f2f2f2; } td.l, th.l { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.note { color: #666; font-size: 0.85em; }
"""


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "&mdash;"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return html.escape(str(v))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 1) -> str:
    """An HTML table; the first ``left`` columns are left-aligned text."""
    def cell(tag: str, i: int, v: str) -> str:
        return f'<{tag} class="l">{v}</{tag}>' if i < left else f"<{tag}>{v}</{tag}>"

    head = "".join(cell("th", i, html.escape(h)) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, _fmt(v)) for i, v in enumerate(r)) + "</tr>\n" for r in rows)
    head_row = f"<tr>{head}</tr>\n" if any(header) else ""  # a key-value table needs no header
    return f"<table>\n{head_row}{body}</table>\n"


def write_html(path: str | Path, results: Mapping[str, Any], files: Sequence[str | Path] = ()) -> Path:
    """Write ``report.html``: summary, plots, per-round, per-cluster, bytes and refusals tables.

    Parameters
    ----------
    path : str or Path
        The page to write.
    results : mapping
        What :func:`build_results` returns.
    files : sequence of str or Path
        The files beside the page (plots, ``results.json``): the page names
        only those of them that exist, by relative file name.

    Returns
    -------
    Path
        ``path``.
    """
    p = Path(path)
    present = {Path(f).name for f in files if (p.parent / Path(f).name).is_file()}
    e = html.escape
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
             f"<title>FedSketch run: {e(str(results.get('strategy', '')))}</title>\n<style>{_CSS}</style>\n"
             "</head>\n<body>\n"]
    parts.append(f"<h1>FedSketch run: {e(str(results.get('strategy', '?')))}</h1>\n")

    clustering = results.get("clustering") or {}
    final_eval = results.get("final_evaluation") or {}
    assignment = results.get("assignment") or {}
    summary: list[tuple[str, Any]] = [
        ("strategy", results.get("strategy")),
        ("clients", results.get("clients")),
        ("clusters", len(set(assignment.values())) if assignment else None),
        ("rounds", results.get("rounds")),
        (f"final accuracy (mean of the last {FINAL_ROUNDS} rounds)", results.get("final_accuracy")),
        ("final evaluation (mean over clients)", final_eval.get("mean")),
        *([("clients evaluated (asked)", f"{final_eval['evaluated']} ({final_eval['asked']})")]
          if "evaluated" in final_eval and "asked" in final_eval else []),
        (f"rounds to {results.get('target_accuracy', 0.8):g} accuracy", results.get("rounds_to_target")),
    ]
    if "ari" in clustering:
        summary.append(("ARI against the true groups", clustering["ari"]))
    if results.get("encoder") is not None:
        summary.append(("encoder", results.get("encoder")))
    total = (results.get("timings") or {}).get("total_s")
    if total is not None:
        summary.append(("seconds", f"{float(total):.1f}"))
    parts.append("<h2>Summary</h2>\n" + _table(["", ""], summary))
    if "results.json" in present:
        parts.append('<p class="note">Every number, with its definition: <a href="results.json">results.json</a>'
                     "</p>\n")

    plots = [("accuracy.png", "Accuracy per round: the mean and each cluster's model"),
             ("threshold_search.png", "The clustering's threshold search"),
             ("bytes.png", "Bytes per message kind")]
    shown = [(f, cap) for f, cap in plots if f in present]
    if shown:
        parts.append("<h2>Plots</h2>\n")
        parts.extend(f'<figure><img src="{e(f)}" alt="{e(cap)}"><figcaption class="note">{e(cap)}</figcaption>'
                     "</figure>\n" for f, cap in shown)

    defs = results.get("definitions") or {}
    accs = results.get("accuracy_per_round") or []
    history = results.get("history") or []
    rows = []
    for i, h in enumerate(history):
        rows.append([h.get("round", i + 1), h.get("tasked"), h.get("updates"), len(h.get("missing") or []),
                     _num(h.get("acc_before")), accs[i] if i < len(accs) else None, _num(h.get("loss")),
                     h.get("model_bytes_delivered"), h.get("clipped"), h.get("refused_norm"),
                     None if h.get("seconds") is None else f"{float(h['seconds']):.1f}"])
    parts.append("<h2>Per round</h2>\n")
    if "accuracy_per_round" in defs:
        parts.append(f'<p class="note">accuracy after the round: {e(defs["accuracy_per_round"])}</p>\n')
    parts.append(_table(["round", "tasked", "updates", "missing", "accuracy before training",
                         "accuracy after the round", "loss", "model bytes downloaded", "clipped",
                         "refused (norm)", "seconds"], rows))

    per_cluster = results.get("accuracy_per_cluster_per_round") or {}
    per_final = final_eval.get("per_cluster") or {}
    members: dict[str, int] = {}
    for key in ((results.get("final") or {}).get("model_per_client") or {}).values():
        members[key] = members.get(key, 0) + 1
    from .metrics import final_accuracy

    rows = [[k, members.get(k), final_accuracy(per_cluster.get(k, []), FINAL_ROUNDS), per_final.get(k)]
            for k in sorted(set(per_cluster) | set(per_final))]
    parts.append("<h2>Per cluster</h2>\n")
    if "accuracy_per_cluster_per_round" in defs:
        parts.append(f'<p class="note">{e(defs["accuracy_per_cluster_per_round"])}</p>\n')
    parts.append(_table(["model", "clients evaluated", f"accuracy (mean of the last {FINAL_ROUNDS} rounds)",
                         "final evaluation"], rows))

    b = results.get("bytes") or {}
    sent, recv, down = (b.get("sent_by_server") or {}, b.get("received_by_server") or {},
                        b.get("downloaded_by_devices") or {})
    rows = []
    for kind in sorted(set(sent) | set(recv) | set(down)):
        s, r = sent.get(kind) or {}, recv.get(kind) or {}
        rows.append([kind, s.get("bytes"), s.get("messages"), r.get("bytes"), r.get("messages"), down.get(kind)])
    rows.append(["total", sum(int((v or {}).get("bytes", 0)) for v in sent.values()),
                 sum(int((v or {}).get("messages", 0)) for v in sent.values()),
                 sum(int((v or {}).get("bytes", 0)) for v in recv.values()),
                 sum(int((v or {}).get("messages", 0)) for v in recv.values()),
                 sum(int(v) for v in down.values())])
    parts.append("<h2>Bytes</h2>\n")
    if "bytes" in defs:
        parts.append(f'<p class="note">{e(defs["bytes"])}</p>\n')
    parts.append(_table(["kind", "sent by server (bytes)", "messages", "received by server (bytes)", "messages",
                         "downloaded by devices (bytes)"], rows))

    parts.append("<h2>Refused and dropped clients</h2>\n")
    rows = [[c, what, reason] for what in ("refused", "dropped")
            for c, reason in sorted((results.get(what) or {}).items())]
    if rows:
        parts.append(_table(["client", "", "reason"], rows, left=3))
    elif "refused" in results or "dropped" in results:
        parts.append("<p>None.</p>\n")
    else:
        parts.append('<p class="note">This server does not record refused or dropped clients.</p>\n')
    rejected = results.get("rejected") or {}
    if rejected:
        parts.append("<p>Messages rejected, per reason:</p>\n"
                     + _table(["reason", "messages"], sorted(rejected.items())))

    if clustering:
        parts.append("<h2>Clustering against the true groups</h2>\n")
        parts.append(_table(["score", "value"], [(k, clustering.get(k)) for k in
                                                 ("ari", "ami", "completeness", "homogeneity", "clients_scored")]))
        for key, what in (("missing_from_truth", "assigned but without a true group"),
                          ("missing_from_assignment", "with a true group but not assigned")):
            if clustering.get(key):
                parts.append(f"<p>Clients {what}: {e(', '.join(map(str, clustering[key])))}</p>\n")
    parts.append("</body>\n</html>\n")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(parts), encoding="utf-8")
    return p


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
