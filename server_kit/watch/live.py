"""The live page: the run's report page while it runs, refreshing itself, with how the run stands now on top.

:func:`live_page` renders the report page (:func:`server_kit.report.page.render_html`)
of the run's result so far, with a refresh in its head (no script, nothing
loaded from elsewhere: it works without internet), and before its summary
the state of the run (:func:`now_section`): the phase, the round and how it
is closing, the devices online, the bytes and refusals so far, and the
accuracy per round per model drawn inline (SVG). When the run is over the
page is the final report itself (:func:`final_page`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from ..report.page import page_head, render_html
from .view import RunView

__all__ = ["REFRESH_PAGE_S", "accuracy_svg", "final_page", "live_page", "now_section"]

#: Seconds between two loads of the live page.
REFRESH_PAGE_S = 2

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def live_page(view: RunView | None, results: Mapping[str, Any] | None) -> str:
    """The page while the run goes on (``results``: ``build_results`` of the run so far, None before one)."""
    head = f'<meta http-equiv="refresh" content="{REFRESH_PAGE_S}">\n'
    now = now_section(view) + accuracy_svg(results or {})
    if results is None:  # nothing to tabulate yet (or the server is busy: the next load has it)
        what = "starting" if view is None else f"{view.strategy}, {view.phase.value}"
        return page_head(what, head) + now + "</body>\n</html>\n"
    return render_html(results, set(), head=head, before=now)


def final_page(results: Mapping[str, Any], report_dir: Path | None) -> bytes:
    """The page once the run is over: its ``report.html`` as written, or rendered from ``results``."""
    if report_dir is not None and (report_dir / "report.html").is_file():
        return (report_dir / "report.html").read_bytes()
    return render_html(results, set()).encode("utf-8")


def now_section(view: RunView | None) -> str:
    """How the run stands now: phase, round and its closing, devices, bytes and refusals so far."""
    if view is None:
        return '<h2>Now</h2>\n<p class="note">The server is starting.</p>\n'
    rows: list[tuple[str, str]] = [("run", view.run_id or "&mdash;"), ("phase", view.phase.value),
                                   ("round", f"{view.round} of {view.rounds_planned}")]
    o = view.open_round
    if o is not None:
        rows.append(("this round", f"{o.reported} reported, {o.refused} refused, {o.awaited} awaited of "
                                   f"{o.tasked} tasked, {o.elapsed_s:.1f} s"
                                   + (": report goal reached, closing after the grace" if o.goal_met else "")))
    last = view.totals
    if last.closed_by:
        rows.append(("rounds closed by", ", ".join(f"{k} {n}" for k, n in sorted(last.closed_by.items()))))
    d = view.devices
    rows.append(("devices", f"{d['online']} online of {d['admitted']} admitted, {d['benched']} benched, "
                            f"{d['refused']} refused at registration"))
    sent = sum(int(c.get("bytes", 0)) for c in (view.transport.get("sent") or {}).values())
    received = sum(int(c.get("bytes", 0)) for c in (view.transport.get("received") or {}).values())
    rows.append(("bytes so far", f"{sent:,} sent, {received:,} received by the server"))
    rejected = sum(view.rejected.values())
    rows.append(("messages refused", f"{rejected:,}" + (" (" + ", ".join(
        f"{escape(k)} {n}" for k, n in sorted(view.rejected.items())) + ")" if rejected else "")))
    h = view.health
    if any(h.exposed.values()):
        hottest = "" if h.max_cpu_temp_c is None else f", hottest CPU {h.max_cpu_temp_c:.1f} \u00b0C"
        rows.append(("health", f"{h.throttled} throttled now{hottest}"))
    body = "".join(f'<tr><td class="l">{escape(k)}</td><td class="l" id="now-{escape(k.replace(" ", "-"))}">'
                   f"{v}</td></tr>\n" for k, v in rows)
    return ('<h2>Now</h2>\n<p class="note">This page reloads itself every '
            f"{REFRESH_PAGE_S} s while the run goes on; at its end it is the run's report.</p>\n"
            f"<table>\n{body}</table>\n")


def accuracy_svg(results: Mapping[str, Any], width: int = 640, height: int = 240) -> str:
    """Accuracy per round, the mean and each model, as an inline SVG ("" before any round measured one)."""
    series: dict[str, Sequence[float | None]] = {"mean": results.get("accuracy_per_round") or []}
    series.update(results.get("accuracy_per_cluster_per_round") or {})
    n = max((len(v) for v in series.values()), default=0)
    if n == 0 or not any(x is not None for v in series.values() for x in v):
        return ""
    pad = 36

    def xy(i: int, a: float) -> str:
        x = pad + (width - 2 * pad) * (i / max(n - 1, 1))
        return f"{x:.1f},{height - pad - (height - 2 * pad) * a:.1f}"

    lines, legend = [], []
    for j, (name, accs) in enumerate(series.items()):
        colour = _COLOURS[j % len(_COLOURS)]
        pts = " ".join(xy(i, float(a)) for i, a in enumerate(accs) if a is not None)
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="{3 if j == 0 else 1.5}" '
                     f'points="{pts}"/>')
        legend.append(f'<text x="{width - pad + 4}" y="{pad + 14 * j}" font-size="11" fill="{colour}">'
                      f"{escape(str(name))}</text>")
    grid = "".join(f'<line x1="{pad}" x2="{width - pad}" y1="{height - pad - (height - 2 * pad) * a}" '
                   f'y2="{height - pad - (height - 2 * pad) * a}" stroke="#ddd"/>'
                   f'<text x="4" y="{height - pad - (height - 2 * pad) * a + 4}" font-size="10">{a:g}</text>'
                   for a in (0.0, 0.25, 0.5, 0.75, 1.0))
    return (f'<h2>Accuracy per round</h2>\n<svg id="accuracy" xmlns="http://www.w3.org/2000/svg" '
            f'width="{width + 60}" height="{height}" role="img" aria-label="accuracy per round">{grid}'
            + "".join(lines) + "".join(legend)
            + f'<text x="{width / 2}" y="{height - 6}" font-size="11">round (1 to {n})</text></svg>\n')
