"""Ours through Flower's Simulation Engine (``flwr run``, Ray) against ours through ``server_kit.drivers.Simulator`` (issue 16).

The same federation, partition and seeds both ways: MNIST (``--data``) in 4
rotation groups with the paper's Dirichlet(10) label skew, 100 nodes,
LeNet-5, half of each cluster trained per round, 10 rounds. Flower runs the
example app ``examples/flower`` with ``flwr run`` on a managed local
SuperLink (its own ``FLWR_HOME`` and ports), 100 virtual SuperNodes on Ray;
``flower_seconds`` is the wall time of that command, start-up included, and
``flower_app_seconds`` the ServerApp's own time (sketches and rounds). Ours
runs the same strategy in this process.

Reported: wall time of each, bytes of each (Flower's: the serialised objects
of its messages, the node greetings and evaluations included; ours: MQTT
messages, no evaluation traffic), the ARI of each, the final accuracy (mean
of the last 5 rounds) and the largest per-round accuracy difference.

``--quick``: scikit-learn's digits, 24 nodes, 3 rounds. ``--ray-address``:
run Flower's simulation on a running Ray cluster (``ray start --head``) instead
of a private one. The last line is JSON with ``flower_seconds``,
``ours_seconds``, ``flower_over_ours``, ``ari_flower``, ``acc_diff``.

Run: ``.venv/bin/python benchmarks/flower_sim.py [--data ../shared/data/mnist] [--quick] [--ray-address ADDR]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower"
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"
sys.path.insert(0, str(APP))


def flwr_run(run_config: dict, nodes: int, *, ray_address: str | None = None, log: Path | None = None
             ) -> tuple[float, dict]:
    """``flwr run`` of the example app on a private local SuperLink; (wall seconds, the app's report)."""
    from server_kit.flower.local_run import flwr_run as run

    report = Path(tempfile.mkdtemp(prefix="fedsketch-flower-sim-")) / "report.json"
    seconds = run(APP, {**run_config, "report": str(report)}, nodes, ray_address=ray_address, log=log)
    return seconds, json.loads(report.read_text())


def run_ours(cfg: dict, nodes: int) -> tuple[float, object]:
    """The same strategy, partition and seeds in :class:`server_kit.drivers.Simulator`."""
    from fedsketch_flower.task import nodes as partition
    from fedsketch_flower.task import setup

    from edge_sdk.encoder import OnnxEncoder
    from server_kit.drivers import Simulator
    from server_kit.flower import FlowerRunConfig, build_strategy

    arch, encoder = setup(cfg)
    clients = list(partition(cfg, nodes))
    t0 = time.perf_counter()
    # the strategy the ServerApp builds from the same run config
    s = build_strategy(FlowerRunConfig.from_run_config({**cfg, "architecture": arch})).strategy
    res = Simulator(s, clients, architecture=arch, encoder=OnnxEncoder(encoder), flip_prob=cfg["flip-prob"],
                    seed=cfg["seed"], progress=True).run(cfg["num-server-rounds"])
    return time.perf_counter() - t0, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="folder with MNIST's IDX files")
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="digits, 24 nodes, 3 rounds")
    ap.add_argument("--ray-address", default=None, help="a running Ray cluster (ray start --head) for Flower")
    ap.add_argument("--log", default=None, help="file for flwr run's output (default: discarded)")
    ap.add_argument("--plot", default=None, help="the accuracy picture (default: benchmarks/figures/"
                                                 "flower_sim_<data>.png; --quick: reports/flower_sim_digits.png)")
    args = ap.parse_args(argv)
    nodes, rounds = (24, 3) if args.quick else (args.nodes, args.rounds)
    cfg = {"strategy": "fedsketch", "num-server-rounds": rounds, "fraction": 0.5, "local-epochs": 1, "lr": 0.001,
           "batch-size": 32, "seed": 0, "flip-prob": 0.1, "groups": 4, "min-nodes": nodes,
           "data": "" if args.quick else str(Path(args.data).resolve()), "alpha": 0.0 if args.quick else 10.0,
           "strategy-params": f"min_cluster_size = {max(2, nodes // 10)}"}
    print(f"Flower: flwr run examples/flower, {nodes} virtual nodes, {rounds} rounds"
          + (f", Ray cluster at {args.ray_address}" if args.ray_address else ""), flush=True)
    flower_s, fl = flwr_run(cfg, nodes, ray_address=args.ray_address, log=Path(args.log) if args.log else None)
    print(f"  {flower_s:.1f} s, ARI {fl.get('ari')}, final accuracy {fl['final_accuracy']:.4f}, "
          f"{fl['bytes_total']:,} bytes", flush=True)
    print("ours: server_kit.drivers.Simulator, same partition and seeds", flush=True)
    ours_s, res = run_ours(cfg, nodes)
    print(f"  {ours_s:.1f} s, ARI {res.ari}, final accuracy {res.final_accuracy:.4f}, {res.total_bytes():,} bytes")
    diffs = [abs(a - b["accuracy"]) for a, b in zip(res.accuracies, fl["rounds"])]
    app_s = fl["seconds_clustering"] + sum(r["seconds"] for r in fl["rounds"])
    out = {
        "nodes": nodes, "rounds": rounds, "data": "digits" if args.quick else "mnist",
        "ray_address": args.ray_address,
        "flower_seconds": round(flower_s, 1), "flower_app_seconds": round(app_s, 1),
        "ours_seconds": round(ours_s, 1), "flower_over_ours": round(flower_s / ours_s, 2),
        "flower_app_over_ours": round(app_s / ours_s, 2),
        "ari_flower": fl.get("ari"), "ari_ours": res.ari,
        "same_clusters": fl["assignment"] == dict(sorted(res.assignment.items())),
        "acc_flower": round(fl["final_accuracy"], 4), "acc_ours": round(res.final_accuracy, 4),
        "acc_diff": round(abs(fl["final_accuracy"] - res.final_accuracy), 4),
        "acc_diff_max_round": round(max(diffs), 4) if diffs else None,
        "bytes_flower": fl["bytes_total"], "bytes_ours": res.total_bytes(),
        "bytes_before_training_flower": fl["bytes_before_training"],
        "bytes_before_training_ours": res.bytes_before_training,
        "rejected_flower": fl["rejected"],
    }
    data = "digits" if args.quick else "mnist"
    plot = Path(args.plot or (ROOT / ("reports" if args.quick else "benchmarks/figures") / f"flower_sim_{data}.png"))
    _plot(plot, fl, res, out)
    print(f"picture: {plot}")
    print(json.dumps(out))
    return 0


def _plot(path: Path, fl: dict, res, out: dict) -> None:
    """Accuracy per round of both runs (one over the other when they agree), and their bytes by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    rounds = [r["round"] for r in fl["rounds"]]
    ax.plot(rounds, res.accuracies, "o-", lw=3, alpha=0.5, label=f"ours (Simulator), {out['ours_seconds']:.0f} s")
    ax.plot(rounds, [r["accuracy"] for r in fl["rounds"]], "x--", color="C3",
            label=f"Flower (flwr run, Ray), {out['flower_seconds']:.0f} s")
    ax.set_xlabel("round")
    ax.set_ylabel("mean local test accuracy of the round's nodes")
    ax.set_xticks(rounds)
    ax.set_title(f"{out['nodes']} nodes, {out['data']}: ARI {out['ari_flower']} (Flower) and {out['ari_ours']} (ours)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    kinds = sorted({k for d in fl["bytes"].values() for k in d})
    fb = [sum(fl["bytes"][d].get(k, {}).get("bytes", 0) for d in ("up", "down")) / 1e6 for k in kinds]
    bx.barh(kinds, fb, color="C3")
    bx.set_xlabel("MB through Flower, by message kind")
    bx.set_title(f"Flower {out['bytes_flower'] / 1e6:.0f} MB, ours {out['bytes_ours'] / 1e6:.0f} MB")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
