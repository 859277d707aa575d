"""What watching a fleet costs the server: its CPU per message with and without ``--metrics-port``, and how fast
``/metrics`` and the live page answer with the whole fleet registered.

Question: does the watch (a view of the run taken every second on the
server's thread, ``/metrics`` read every second as Prometheus would, the
live page every 2 s as a person would) cost the server under 2 % of its CPU
per message, and does ``/metrics`` answer in under 50 ms with 10,000 devices
registered?

Per size N (``--sizes``, default 10000; ``--quick``: 100), ``--repeats``
triples of runs of ``benchmarks/fleet.py``'s fleet (the shipped Mosquitto, N
emulated devices, the real server in its own process, 3 rounds), in turns:
one without the watch (the baseline, in this same process), one with
``--metrics-port`` and ``/metrics`` read every second (Prometheus), one with
the live page read every 2 s too (a person watching). A run counts only when it lost no device
and the server finished; the CPU per message is the server's user + system
time over every message it sent and received.

Run: ``.venv/bin/python benchmarks/watch.py`` (about 70 s per run of
10,000 devices on 2 cores). The last line is JSON, per size N:
``cpu_per_msg_ratio_metrics_N`` and ``cpu_per_msg_ratio_page_N`` (over the
baseline: 1.02 is 2 % more; runs differ by a few % on a shared machine),
``watch_cpu_share_metrics_N`` and ``watch_cpu_share_page_N`` (the CPU the
watch itself took, ``fedsketch_watch_cpu_seconds_total``, over the server's
in the same run), ``metrics_ms_p50_metrics_N``,
``metrics_ms_max_metrics_N``, ``page_ms_p50_N``, ``series_N`` (lines of one
``/metrics`` answer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The runs of each pair: no watch (the baseline), /metrics read every second, and the live page every 2 s too.
KINDS = ("none", "metrics", "page")
DESCRIBED = {"metrics": "/metrics read every second", "page": "/metrics every second and the live page every 2 s"}


def _fleet():
    spec = importlib.util.spec_from_file_location("fleet_bench", Path(__file__).with_name("fleet.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000", help="fleet sizes, comma-separated")
    p.add_argument("--quick", action="store_true", help="one pair of runs of 100 devices")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs (without, with) per size")
    p.add_argument("--out", default="reports/watch", help="results folder")
    p.add_argument("--kinds", default=",".join(KINDS), help="the runs of each turn: none (the baseline), metrics, page")
    args = p.parse_args(argv)
    fleet = _fleet()
    sizes = [100] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]
    repeats = 1 if args.quick else args.repeats
    out = ROOT / args.out
    summary: dict[str, object] = {}
    rows = []
    for n in sizes:
        kinds = [k for k in KINDS if k in args.kinds.split(",")]
        per: dict[str, list] = {kind: [] for kind in kinds}
        for r in range(repeats):
            for kind in kinds:
                ns = fleet.build_parser().parse_args(["--sizes", str(n), *(["--watch", kind] if kind != "none" else [])])
                row = fleet.run_size(n, ns, out / f"{kind}-{r}")
                why = fleet.incomplete(row)
                if why is None and kind != "none" and (not row.get("scrapes") or row.get("watch_cpu_s") is None):
                    why = "the endpoint never answered: nothing was watched"
                if why:
                    print(f"watch.py: N={n}, watch {kind}, run {r}: not a measurement ({why})", file=sys.stderr)
                    continue
                per[kind].append(row)
                rows.append({"devices": n, "watch": kind, **{k: row.get(k) for k in (
                    "server_cpu_s", "server_messages", "server_us_per_msg", "scrapes", "metrics_ms_p50",
                    "metrics_ms_p90", "metrics_ms_max", "metrics_slowest_at_s", "register_s", "sketch_s", "cluster_s",
                    "page_ms_p50", "page_ms_max", "series", "scrapes_failed", "watch_cpu_s", "ari", "lost")}})
                print(json.dumps(rows[-1]), file=sys.stderr)
        if "none" not in per or not all(per.values()):
            summary[f"incomplete_{n}"] = "a run of each kind must finish with no device lost"
            continue
        base = statistics.median(r["server_us_per_msg"] for r in per["none"])
        summary[f"server_us_per_msg_without_{n}"] = round(base, 1)
        for kind in [k for k in ("metrics", "page") if k in per]:
            us = statistics.median(r["server_us_per_msg"] for r in per[kind])
            summary.update({
                f"server_us_per_msg_{kind}_{n}": round(us, 1), f"cpu_per_msg_ratio_{kind}_{n}": round(us / base, 4),
                f"metrics_ms_p50_{kind}_{n}": statistics.median(r["metrics_ms_p50"] for r in per[kind]),
                f"metrics_ms_p90_{kind}_{n}": statistics.median(r["metrics_ms_p90"] for r in per[kind]),
                f"metrics_ms_max_{kind}_{n}": max(r["metrics_ms_max"] for r in per[kind]),
                f"scrapes_failed_{kind}_{n}": sum(r["scrapes_failed"] for r in per[kind]),
                # the watch's own CPU over the server's, the same run: its share of the CPU per message
                f"watch_cpu_share_{kind}_{n}": round(statistics.median(
                    r["watch_cpu_s"] / r["server_cpu_s"] for r in per[kind]), 5)})
            print(f"N={n}, {DESCRIBED[kind]}: server CPU per message {us:.1f} us against {base:.1f} us without "
                  f"({us / base:.3f}x; the watch's own share of the server's CPU "
                  f"{100 * summary[f'watch_cpu_share_{kind}_{n}']:.2f} %); /metrics answered in {summary[f'metrics_ms_p50_{kind}_{n}']} ms (median), "
                  f"{summary[f'metrics_ms_max_{kind}_{n}']} ms at most")
        if "page" in per:
            summary[f"page_ms_p50_{n}"] = statistics.median(r["page_ms_p50"] for r in per["page"])
            summary[f"page_ms_max_{n}"] = max(r["page_ms_max"] for r in per["page"])
            print(f"N={n}: the live page answered in {summary[f'page_ms_p50_{n}']:.1f} ms (median)")
        watched = [r for kind in ("metrics", "page") for r in per.get(kind, [])]
        if watched:
            summary[f"series_{n}"] = max(r["series"] for r in watched)
    (out / "results.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(json.dumps(summary))
    return 0 if all(not k.startswith("incomplete") for k in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
