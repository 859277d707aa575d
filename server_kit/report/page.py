"""The report's HTML page: one self-contained ``report.html`` (inline CSS, no script), a section per step.

:func:`write_html` puts together the summary, the plots (by relative file
name), and the tables per round, per cluster, of bytes, of refused and
dropped clients and of the clustering against the true groups; each
section has its own function below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from ..ids import some_ids
from .results import FINAL_ROUNDS, number_or_none

__all__ = ["FLEET_ROWS", "page_head", "render_html", "write_html"]

#: Devices the page's devices table shows (the most refused, then the slowest); results.json has them all.
FLEET_ROWS = 200

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
    return escape(str(v))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 1) -> str:
    """An HTML table; the first ``left`` columns are left-aligned text."""
    def cell(tag: str, i: int, v: str) -> str:
        return f'<{tag} class="l">{v}</{tag}>' if i < left else f"<{tag}>{v}</{tag}>"

    head = "".join(cell("th", i, escape(h)) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, _fmt(v)) for i, v in enumerate(r)) + "</tr>\n" for r in rows)
    head_row = f"<tr>{head}</tr>\n" if any(header) else ""  # a key-value table needs no header
    return f"<table>\n{head_row}{body}</table>\n"


def _note(defs: Mapping[str, str], key: str, prefix: str = "") -> str:
    """The definition of ``key`` as a note under a heading ("" when the results do not define it)."""
    return f'<p class="note">{prefix}{escape(defs[key])}</p>\n' if key in defs else ""


def write_html(path: str | Path, results: Mapping[str, Any], files: Sequence[str | Path] = ()) -> Path:
    """Write ``report.html``: summary, plots, per-round, per-cluster, bytes, devices and refusals tables.

    Parameters
    ----------
    path : str or Path
        The page to write.
    results : mapping
        What :func:`~server_kit.report.build_results` returns.
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
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_html(results, present), encoding="utf-8")
    return p


def render_html(results: Mapping[str, Any], present: set[str], *, head: str = "", before: str = "") -> str:
    """The report page of ``results`` naming the files ``present`` beside it; ``head``: more of its head (the
    live page's refresh), ``before``: HTML before its summary (the live page's state of the run)."""
    defs = results.get("definitions") or {}
    parts = [_head(results, head), before, _summary(results, present), _plots(present), _per_round(results, defs),
             _per_cluster(results, defs), _models(results), _bytes(results, defs), _fleet(results),
             _devices(results), _privacy(results), _refusals(results), _truth(results), "</body>\n</html>\n"]
    return "".join(parts)


def _head(results: Mapping[str, Any], more: str = "") -> str:
    return page_head(str(results.get("strategy", "?")), more)


def page_head(what: str, more: str = "") -> str:
    """The page's start, up to its title ("FedSketch run: WHAT"); ``more``: more of its head."""
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n{more}"
            f"<title>FedSketch run: {escape(what)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            f"<h1>FedSketch run: {escape(what)}</h1>\n")


def _summary(results: Mapping[str, Any], present: set[str]) -> str:
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
    out = "<h2>Summary</h2>\n" + _table(["", ""], summary)
    if "results.json" in present:
        out += ('<p class="note">Every number, with its definition: <a href="results.json">results.json</a>'
                "</p>\n")
    return out


def _plots(present: set[str]) -> str:
    plots = [("accuracy.png", "Accuracy per round: the mean and each cluster's model"),
             ("threshold_search.png", "The clustering's threshold search"),
             ("bytes.png", "Bytes per message kind")]
    shown = [(f, cap) for f, cap in plots if f in present]
    if not shown:
        return ""
    return "<h2>Plots</h2>\n" + "".join(
        f'<figure><img src="{escape(f)}" alt="{escape(cap)}"><figcaption class="note">{escape(cap)}</figcaption>'
        "</figure>\n" for f, cap in shown)


def _per_round(results: Mapping[str, Any], defs: Mapping[str, str]) -> str:
    accs = results.get("accuracy_per_round") or []
    history = results.get("history") or []
    rows = []
    for i, h in enumerate(history):
        rows.append([h.get("round", i + 1), h.get("tasked"), h.get("updates"), len(h.get("stragglers") or []),
                     len(h.get("refused") or {}), number_or_none(h.get("acc_before")),
                     accs[i] if i < len(accs) else None, number_or_none(h.get("loss")),
                     h.get("model_bytes_delivered"), h.get("clipped"), h.get("close"),
                     None if h.get("seconds") is None else f"{float(h['seconds']):.1f}"])
    return ("<h2>Per round</h2>\n" + _note(defs, "accuracy_per_round", "accuracy after the round: ")
            + _note(defs, "rounds_closing", "closing: ")
            + _table(["round", "tasked", "updates", "stragglers", "refused", "accuracy before training",
                      "accuracy after the round", "loss", "model bytes downloaded", "clipped", "closed by",
                      "seconds"], rows))


def _per_cluster(results: Mapping[str, Any], defs: Mapping[str, str]) -> str:
    from ..metrics import final_accuracy

    per_cluster = results.get("accuracy_per_cluster_per_round") or {}
    per_final = (results.get("final_evaluation") or {}).get("per_cluster") or {}
    members: dict[str, int] = {}
    for key in ((results.get("final") or {}).get("model_per_client") or {}).values():
        members[key] = members.get(key, 0) + 1
    rows = [[k, members.get(k), final_accuracy(per_cluster.get(k, []), FINAL_ROUNDS), per_final.get(k)]
            for k in sorted(set(per_cluster) | set(per_final))]
    return ("<h2>Per cluster</h2>\n" + _note(defs, "accuracy_per_cluster_per_round")
            + _table(["model", "clients evaluated", f"accuracy (mean of the last {FINAL_ROUNDS} rounds)",
                      "final evaluation"], rows))


def _bytes(results: Mapping[str, Any], defs: Mapping[str, str]) -> str:
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
    return ("<h2>Bytes</h2>\n" + _note(defs, "bytes")
            + _table(["kind", "sent by server (bytes)", "messages", "received by server (bytes)", "messages",
                      "downloaded by devices (bytes)"], rows))


def _models(results: Mapping[str, Any]) -> str:
    """The trained models as exported (``models/``): where each one is, what it scored, its weights' sha256."""
    exported = results.get("models") or {}
    if not exported.get("models"):
        return ""
    folder = escape(str(exported.get("folder", "models")))
    rows = [[m["key"], m.get("cluster"), m.get("members"), m.get("samples"), m.get("accuracy"), m.get("evaluated"),
             m["files"].get(f"{m['key']}/weights.safetensors", "")[:16] + "..."] for m in exported["models"]]
    return ("<h2>Trained models</h2>\n<p class=\"note\">Each model the run trained, in "
            f'<a href="{folder}/models.json"><code>{folder}/</code></a>: a standalone ONNX file (ONNX Runtime runs '
            "it alone), its weights (safetensors) and <code>model.json</code>. <code>fedsketch predict --model "
            f"{folder}/KEY --data FILE.npz</code> predicts with one; every device of the run keeps its own "
            "(<code>fedsketch-client --model-dir</code>). Accuracy: the final evaluation's mean over the "
            "devices that evaluated it.</p>\n"
            + _table(["model", "cluster", "devices", "samples", "accuracy", "evaluated by", "weights sha256"], rows,
                     left=1))


def _fleet(results: Mapping[str, Any]) -> str:
    """Every device's state: online, cluster, last seen, rounds done, refusals, bench, health (bounded)."""
    fleet = results.get("fleet") or {}
    if not fleet:
        return ""
    order = sorted(fleet, key=lambda c: (-int(fleet[c].get("refusals") or 0), -float(fleet[c].get("round_s") or 0),
                                         c))[:FLEET_ROWS]
    rows = []
    for c in order:
        d, h = fleet[c], fleet[c].get("health") or {}
        throttled = h.get("throttled")
        rows.append([c, "yes" if d.get("online") else "no", d.get("cluster"), _secs(d.get("last_seen_s")),
                     d.get("rounds"), d.get("refusals"), _secs(d.get("round_s")), _secs(d.get("sketch_ms")),
                     _secs(h.get("cpu_temp_c")), None if throttled is None else hex(int(throttled)),
                     _secs(h.get("mem_available_mb")), _secs(h.get("load1")), d.get("last_refusal") or d.get("benched")])
    more = len(fleet) - len(order)
    note = f" The {len(order)} most refused and slowest of {len(fleet):,}; every device is in results.json." if more \
        else ""
    return ("<h2>Devices</h2>\n<p class=\"note\">Each admitted device: online, its model, seconds since its last "
            "message, rounds whose update was kept, refused updates, its last round's seconds, its own bench's "
            "sketch time, and the health it last sent (&mdash;: not exposed by its board)." + note + "</p>\n"
            + _table(["device", "online", "model", "last seen s", "rounds", "refusals", "round s", "sketch ms",
                      "CPU \u00b0C", "throttled", "memory free MB", "load", "refused or benched for"], rows, left=3))


def _secs(v: Any) -> str | None:
    return None if v is None else f"{float(v):g}"


def _devices(results: Mapping[str, Any]) -> str:
    """The devices' own benchmarks (those whose hello carried one), slowest sketch first."""
    devices = results.get("devices") or {}
    if not devices:
        return ""
    cols = ["sketch_ms", "epoch_ms", "epoch_over_sketch", "cores", "mem_mb"]
    order = sorted(devices, key=lambda c: (-float(devices[c].get("sketch_ms") or 0), c))
    rows = [[c, devices[c].get("cpu"), *(f"{float(devices[c][k]):g}" if devices[c].get(k) is not None else None
                                         for k in cols)] for c in order]
    return ("<h2>Devices' own benchmarks</h2>\n<p class=\"note\">What each device measured on itself with "
            "<code>fedsketch bench</code> and sent with its hello (<code>fedsketch-client --bench FILE</code>); "
            "slowest sketch first.</p>\n"
            + _table(["client", "CPU", "sketch ms", "epoch ms", "epoch / sketch", "cores", "memory MB"], rows, left=2))


def _eps(v: Any) -> str:
    return "infinite" if v is None else f"{float(v):.3g}"


def _privacy(results: Mapping[str, Any]) -> str:
    """What the run gave away: the sketches' epsilons per device; the clusters' DP accountants; the secure sums."""
    privacy = results.get("privacy") or {}
    out = ""
    sk = privacy.get("sketch")
    if sk:
        out += ("<h2>Privacy</h2>\n<p>Each sketch: epsilon " + _eps(sk.get("epsilon_per_device"))
                + " per device (user level), " + _eps(sk.get("epsilon_per_image")) + " per image, "
                + _eps(sk.get("epsilon_per_bit")) + f" per bit (flip probability {sk.get('flip_prob')}, "
                f"{sk.get('bits')} bits).</p>\n<p class=\"note\">{escape(str(sk.get('threat_model', '')))}.</p>\n")
        groups: dict[tuple[Any, str], list[str]] = {}
        for c, d in (sk.get("devices") or {}).items():
            groups.setdefault((d.get("sketches"), _eps(d.get("epsilon"))), []).append(c)
        rows = [[len(cs), k, e, some_ids(cs, 8)] for (k, e), cs in sorted(groups.items(), key=lambda kv: str(kv[0]))]
        declined = sk.get("declined") or []
        if declined:
            rows.append([len(declined), 0, "declined (its budget)", some_ids(list(declined), 8)])
        if rows:
            out += _table(["devices", "sketches sent", "epsilon spent (per device)", "which"], rows)
    dp = privacy.get("dp")
    if dp:
        out += (("" if sk else "<h2>Privacy</h2>\n") + f"<p>Differentially private cluster models (DP-FedAvg, "
                f"user level): budget epsilon {dp.get('epsilon_budget')} at delta {dp.get('delta')} per cluster, "
                f"clip {dp.get('clip')}.</p>\n")
        rows = [[k, f"{c.get('per_round')} of {c.get('members')}", _fmt(c.get("noise_multiplier"), 3),
                 c.get("rounds"), _eps(c.get("epsilon")), c.get("stopped") or ""]
                for k, c in sorted((dp.get("clusters") or {}).items())]
        out += _table(["model", "devices a round", "noise multiplier", "private rounds", "epsilon spent", "stopped"],
                      rows)
    sec = privacy.get("secure")
    if sec:
        out += (("" if sk or dp else "<h2>Privacy</h2>\n") + f"<p>Secure aggregation: {sec.get('rounds', 0)} "
                f"cluster rounds summed without the server seeing one device's update ({sec.get('survivors', 0)} "
                f"masked updates; {sec.get('dropped', 0)} tasked devices sent none and were cancelled out); "
                f"{sec.get('failed', 0)} cluster rounds not summed (their models stayed as they were). Bytes: "
                f"{sec.get('bytes_masked_updates', 0):,} of masked updates, {sec.get('bytes_unmask_requests', 0):,} of "
                f"unmask requests, {sec.get('bytes_reveals', 0):,} of reveals.</p>\n")
    return out


def _refusals(results: Mapping[str, Any]) -> str:
    out = "<h2>Refused and dropped clients</h2>\n"
    rows = [[c, what, reason] for what in ("refused", "dropped", "benched")
            for c, reason in sorted((results.get(what) or {}).items())]
    if rows:
        out += _table(["client", "", "reason"], rows, left=3)
    elif "refused" in results or "dropped" in results:
        out += "<p>None.</p>\n"
    else:
        out += '<p class="note">This server does not record refused or dropped clients.</p>\n'
    rejected = results.get("rejected") or {}
    if rejected:
        out += "<p>Messages rejected, per reason:</p>\n" + _table(["reason", "messages"], sorted(rejected.items()))
    return out


def _truth(results: Mapping[str, Any]) -> str:
    clustering = results.get("clustering") or {}
    if not clustering:
        return ""
    out = "<h2>Clustering against the true groups</h2>\n"
    out += _table(["score", "value"], [(k, clustering.get(k)) for k in
                                       ("ari", "ami", "completeness", "homogeneity", "clients_scored")])
    for key, what in (("missing_from_truth", "assigned but without a true group"),
                      ("missing_from_assignment", "with a true group but not assigned")):
        if clustering.get(key):
            out += f"<p>Clients {what}: {escape(', '.join(map(str, clustering[key])))}</p>\n"
    return out
