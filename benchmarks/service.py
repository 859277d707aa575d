"""Does a device in service mode stay the same over months of runs? 20 successive runs against one server.

Four ``fedsketch-client --serve`` processes (two rotation groups of
scikit-learn's digits, the server's public key) over a Mosquitto broker on a
free port; ``fedsketch-server`` runs one after the other (fedsketch strategy,
``--rounds`` rounds each), and one run killed (SIGKILL) as it clusters, after
``--crash-after`` runs. After each run the benchmark reads every device's
resident memory (VmRSS), the files in its temporary folder and the size of
its log. No device is restarted.

The baseline is run 2 (run 1 includes the imports and first allocations):
``rss_ratio`` is each device's RSS after the last run over its RSS after run
2 (goal: within 10 %, i.e. <= 1.10). At the end the signed
``fedsketch-server --leave all`` ends the devices, and what they left on
disk is listed (goal: nothing).

Run: ``.venv/bin/python benchmarks/service.py [--runs 20]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server_kit import cli  # noqa: E402
from server_kit.broker import MosquittoBroker  # noqa: E402
from server_kit.service_fleet import (  # noqa: E402
    run_server,
    start_service_devices,
    stop_devices,
    write_rotated_digits,
)

FED = "service"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="successful runs against the same devices")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="training rounds per run")
    ap.add_argument("--crash-after", type=int, default=10, help="kill the server of an extra run after this run")
    args = ap.parse_args(argv)
    from sklearn.metrics import adjusted_rand_score
    from tqdm import tqdm

    from edge_sdk.signing import write_keypair

    n = args.devices
    truth = {f"c{i:02d}": i % 2 for i in range(n)}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fedsketch-service-") as tmp, MosquittoBroker() as broker:
        work = Path(tmp)
        key, pub = work / "server.key", work / "server.pub"
        write_keypair(key, pub)
        data = write_rotated_digits(work / "data", n, groups=2)
        devices = start_service_devices(broker.url, data, work / "devices", federation=FED, server_key=str(pub))
        t0 = time.monotonic()
        try:
            crashed = None
            for i in tqdm(range(1, args.runs + 1), desc="runs", unit="run"):
                run = run_server(broker.url, work / f"run{i}", federation=FED, min_clients=n, rounds=args.rounds,
                                 signing_key=str(key))
                if run.rc != 0 or run.results is None:
                    print(f"run {i} failed (exit {run.rc}):\n{run.log[-3000:]}", file=sys.stderr)
                    return 1
                a = run.results["assignment"]
                rows.append({
                    "run": i, "seconds": round(run.seconds, 2), "run_id": run.results.get("run_id"),
                    "ari": float(adjusted_rand_score([truth[c] for c in sorted(truth)], [a[c] for c in sorted(truth)])),
                    "accuracy": run.results["final"].get("accuracy"),
                    "rss_kib": [d.rss_kib() for d in devices], "files": [len(d.files()) for d in devices],
                    "log_bytes": [d.log_bytes() for d in devices],
                })
                if i == args.crash_after:
                    crashed = run_server(broker.url, work / "crash", federation=FED, min_clients=n,
                                         signing_key=str(key), kill_when="registration closed")
            alive = all(d.proc.poll() is None for d in devices)
            assert cli.main(["--broker", broker.url, "--federation", FED, "--signing-key", str(key),
                             "--leave", "all"]) == 0
            end = time.monotonic() + 30
            while time.monotonic() < end and any(d.proc.poll() is None for d in devices):
                time.sleep(0.2)
            codes = [d.proc.poll() for d in devices]
        finally:
            stop_devices(devices)
        left = {d.cid: d.files() for d in devices if d.files()}
        joined = [d.log().count(": joining it") for d in devices]
        elapsed = time.monotonic() - t0

    base, last = rows[min(1, len(rows) - 1)], rows[-1]
    ratios = [b and v / b for b, v in zip(base["rss_kib"], last["rss_kib"])]
    log_growth = [(l2 - l1) for l1, l2 in zip(rows[min(1, len(rows) - 1)]["log_bytes"], last["log_bytes"])]
    per_run_log = [round(g / max(1, len(rows) - 2), 1) for g in log_growth]
    print(f"{'run':>4} {'s':>6} {'ARI':>5} {'acc':>6}  RSS MiB per device            files  log KiB")
    for r in rows:
        print(f"{r['run']:>4} {r['seconds']:>6.1f} {r['ari']:>5.2f} {r['accuracy'] or 0:>6.3f}  "
              + " ".join(f"{k / 1024:6.1f}" for k in r["rss_kib"])
              + f"  {'/'.join(map(str, r['files'])):>9}  " + " ".join(f"{b / 1024:5.1f}" for b in r["log_bytes"]))
    print(f"RSS after run {last['run']} / after run {base['run']}: " + ", ".join(f"{x:.3f}" for x in ratios))
    print(f"log growth per run (bytes, each device): {per_run_log}")
    print(f"server crash after run {args.crash_after}: "
          f"{'killed as it clustered' if crashed and crashed.killed else 'not played'}; devices alive after "
          f"all runs: {alive}; runs each device joined: {joined}; exit codes after the signed leave: {codes}")
    print(f"left on disk after they exited: {left or 'nothing'}")
    print(json.dumps({
        "runs": len(rows), "devices": n, "crash_after": args.crash_after, "all_ari_1": all(r["ari"] == 1.0 for r in rows),
        "rss_ratio_max": round(max(ratios), 4), "rss_ratio_min": round(min(ratios), 4),
        "rss_mib_last": [round(k / 1024, 1) for k in last["rss_kib"]],
        "files_per_run_max": max(max(r["files"]) for r in rows), "files_per_run_min": min(min(r["files"]) for r in rows),
        "log_bytes_per_run": per_run_log, "joined": joined, "exit_codes": codes, "left_on_disk": sum(map(len, left.values())),
        "alive_through_runs": alive, "seconds": round(elapsed, 1),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
