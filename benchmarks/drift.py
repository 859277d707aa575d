"""Data that drifts: ours with drift handling against ours static, IFCA and FedAvg (issue 15).

MNIST (``--data``), 100 devices in 4 rotation groups (0, 90, 180, 270 degrees),
LeNet-5, 50 % of each cluster's devices per round, 40 rounds. Before round
15, 15 devices of group 0 take group 1's rotation (they should migrate) and 12
devices of group 2 take a 45-degree rotation nobody had (they should form a
new cluster). Methods, on the same devices, seeds and drift:

- ``ours-static``: the paper's method, clustered once before training (today);
- ``ours-drift``: ours following drift: a device whose data changed sends a
  fresh sketch unasked, the server moves it, pools it or makes a new cluster;
- ``ifca-4``, ``ifca-5``: IFCA with K models (every device gets all K each round);
- ``fedavg``: one global model.

Per round: the mean local test accuracy of the drifted devices and of the
others (every device evaluated with its current model), and the ARI of the
assignment against the truth of that round. Reported: rounds after the drift
until the drifted devices are back within 1 point of their accuracy before
it, ARI against the post-drift truth, extra bytes per device for drift
handling, the bytes of each method, and ``drift_accuracy.png``.

``--quick``: digits, 24 devices, 8 rounds, drift before round 4 (3 to another
group, 4 relabelled: a transform nobody had, which digits' 8x8 images show
better than a 45-degree turn). The last line is JSON.

Run: ``.venv/bin/python benchmarks/drift.py [--data ../shared/data/mnist] [--rounds 40] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from _cli import add_device_options

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"
METHODS = ("ours-static", "ours-drift", "ifca-4", "ifca-5", "fedavg")


def build(args):
    """(clients, drift schedule, architecture, encoder name)."""
    from server_kit.data.drift import DriftEvent, DriftSchedule, rotation_drift
    from server_kit.data.partition import load_digits_images, rotation_groups

    if args.dataset == "digits":
        images, labels = load_digits_images()
        clients = rotation_groups(images, labels, args.clients, groups=4, seed=args.seed)
        moved = rotation_drift(clients, round=args.drift_round, moves=[(0, 1, args.moves)], seed=args.seed)
        g2 = sorted(c.cid for c in clients if c.group == 2 and c.cid not in moved.drifted())[: args.new]
        relabel = tuple((c + 5) % 10 for c in range(10))
        sched = DriftSchedule([*moved.events, DriftEvent(args.drift_round, tuple(g2), 4, relabel=relabel)])
        return clients, sched, "digits_cnn_1x8x8_10", "digits_encoder"
    from server_kit.data.idx import load_mnist

    images, labels = load_mnist(args.data, "train")
    clients = rotation_groups(images, labels, args.clients, groups=4, seed=args.seed,
                              **({"alpha": args.alpha, "min_size": 10} if args.alpha else {}))
    sched = rotation_drift(clients, round=args.drift_round, moves=[(0, 1, args.moves)],
                           new=[(2, 4, 45.0, args.new)], seed=args.seed)
    return clients, sched, "lenet5_1x28x28_10", "fmnist_fc_encoder"


def make(name, args, arch):
    from edge_sdk.tasks import TrainSettings
    from server_kit.strategies.fedavg import FedAvg
    from server_kit.strategies.fedsketch import SketchClustered
    from server_kit.strategies.ifca import IFCA

    common = dict(settings=TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size),
                  fraction=args.fraction, seed=args.seed)
    mcs = max(3, args.clients // 10)
    if name == "ours-static":
        return SketchClustered(min_cluster_size=mcs, **common)
    if name == "ours-drift":
        return SketchClustered(min_cluster_size=mcs, follow_drift=True, flip_prob=args.flip_prob, **common)
    if name.startswith("ifca-"):
        return IFCA(k=int(name.split("-")[1]), architecture=arch, **common)
    return FedAvg(**common)


def run_method(name, args, clients, sched, arch, encoder) -> dict:
    """One method: per-round accuracies of drifted and other devices, ARI per round, bytes."""
    from sklearn.metrics import adjusted_rand_score

    from edge_sdk import OnnxEncoder
    from server_kit.drivers.simulate import Simulator

    t0 = time.perf_counter()
    s = make(name, args, arch)
    sim = Simulator(s, clients, architecture=arch, encoder=OnnxEncoder(encoder), flip_prob=args.flip_prob,
                    seed=args.seed, drift=sched, device=args.device, batched=args.batched,
                    step=args.step)
    drifted = set(sched.drifted())
    per_round = []

    def watch(strategy, record) -> bool:
        accs = {cid: sim.workers[cid].evaluate(strategy.models[strategy.model_key_for(cid)])["accuracy"] for cid in sim.workers}
        truth = sched.truth(clients, record.round)
        assign = strategy.clusters()
        cids = sorted(truth)
        per_round.append({
            "round": record.round,
            "drifted_acc": float(np.mean([accs[c] for c in drifted])),
            "others_acc": float(np.mean([accs[c] for c in cids if c not in drifted])),
            "ari": float(adjusted_rand_score([truth[c] for c in cids], [assign.get(c, -1) for c in cids])),
            "bytes": record.bytes_total,
            "drift": record.summary.get("drift"),
        })
        log.info("%s round %d: drifted %.3f, others %.3f, ARI %.3f", name, record.round,
                 per_round[-1]["drifted_acc"], per_round[-1]["others_acc"], per_round[-1]["ari"])
        return False

    res = sim.run(args.rounds, stop=watch)
    row = {"rounds": per_round, "bytes": res.total_bytes(), "drift_bytes": res.drift_bytes,
           "seconds": time.perf_counter() - t0, "clusters": len(set(res.assignment.values())),
           "recovery_rounds": recovery(per_round, args.drift_round),
           "moves": getattr(getattr(s, "drift_", None), "counts", None)}
    last = per_round[-1]
    print(f"  {name:12s} drifted {last['drifted_acc']:.4f}  others {last['others_acc']:.4f}  ARI "
          f"{last['ari']:.3f}  recovery {row['recovery_rounds']}  {row['bytes'] / 1e6:8.1f} MB  "
          f"{row['seconds']:.0f} s", flush=True)
    return row


def recovery(per_round: list[dict], drift_round: int) -> int | None:
    """Rounds after the drift until the drifted devices are within 1 point of their pre-drift accuracy."""
    before = [r["drifted_acc"] for r in per_round if r["round"] == drift_round - 1]
    if not before:
        return None
    for r in per_round:
        if r["round"] >= drift_round and r["drifted_acc"] >= before[0] - 0.01:
            return r["round"] - drift_round + 1
    return None


def plot(path: Path, rows: dict, drift_round: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, row in rows.items():
        r = [x["round"] for x in row["rounds"]]
        axes[0].plot(r, [x["drifted_acc"] for x in row["rounds"]], marker=".", label=name)
        axes[1].plot(r, [x["others_acc"] for x in row["rounds"]], marker=".", label=name)
    for ax, what in zip(axes, ("drifted devices", "the other devices")):
        ax.axvline(drift_round - 0.5, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{what} (drift before round {drift_round})")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean local test accuracy")
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> dict:
    from server_kit.report import write_json

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    clients, sched, arch, encoder = build(args)
    print(f"{len(clients)} devices ({args.dataset}), 4 rotation groups, {args.rounds} rounds; before round "
          f"{args.drift_round}: {len(sched.events[0].clients)} devices of group 0 take group 1's transform, "
          f"{len(sched.events[1].clients)} of group 2 a new one", flush=True)
    rows = {name: run_method(name, args, clients, sched, arch, encoder) for name in args.methods}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(out / "drift_accuracy.png", rows, args.drift_round, f"{args.dataset}: {len(clients)} devices, drift")
    write_json(out / "results.json", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    ours = rows.get("ours-drift")
    static = rows.get("ours-static")
    ifca = rows.get("ifca-4") or rows.get("ifca-5")
    post = [r for r in ours["rounds"] if r["round"] >= args.drift_round] if ours else []
    summary = {
        "recovery_rounds": ours["recovery_rounds"] if ours else None,
        "ari_after_drift": round(post[-1]["ari"], 4) if post else None,
        "ari_round_drift_plus_3": next((round(r["ari"], 4) for r in post if r["round"] == args.drift_round + 3),
                                       None),
        "extra_bytes_per_device": round(ours["drift_bytes"] / len(clients), 1) if ours else None,
        "ifca_bytes_over_ours": round(ifca["bytes"] / ours["bytes"], 3) if ifca and ours else None,
        "drifted_final_acc": round(ours["rounds"][-1]["drifted_acc"], 4) if ours else None,
        "static_drifted_final_acc": round(static["rounds"][-1]["drifted_acc"], 4) if static else None,
        "ifca_drifted_final_acc": {n: round(r["rounds"][-1]["drifted_acc"], 4) for n, r in rows.items()
                                   if n.startswith("ifca")},
        "fedavg_drifted_final_acc": round(rows["fedavg"]["rounds"][-1]["drifted_acc"], 4) if "fedavg" in rows
        else None,
        "bytes": {n: r["bytes"] for n, r in rows.items()},
        "dataset": args.dataset, "devices": len(clients), "rounds": args.rounds,
        "seconds": round(time.perf_counter() - t_all, 1),
    }
    print(f"report: {out}/results.json, {out}/drift_accuracy.png")
    return summary


log = logging.getLogger("benchmarks.drift")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_options(ap)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--drift-round", type=int, default=15)
    ap.add_argument("--moves", type=int, default=15, help="devices of group 0 that take group 1's rotation")
    ap.add_argument("--new", type=int, default=12, help="devices of group 2 that take a 45-degree rotation")
    ap.add_argument("--alpha", type=float, default=0.0,
                    help="Dirichlet label skew of the devices (0: equal shards; the paper's table uses 10)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    ap.add_argument("--out", default="reports/drift")
    ap.add_argument("--quick", action="store_true", help="digits, 24 devices, 8 rounds: the smoke test")
    ap.add_argument("--verbose", action="store_true", help="a log line per method and round")
    args = ap.parse_args(argv)
    if args.quick:
        args.dataset, args.clients, args.rounds, args.drift_round = "digits", 24, 8, 4
        args.moves, args.new, args.lr, args.batch_size, args.fraction = 3, 4, 1e-2, 16, 1.0
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if not 2 <= args.drift_round <= args.rounds:
        ap.error(f"--drift-round must be between 2 and --rounds ({args.rounds}), got {args.drift_round}")
    if args.dataset == "mnist" and not Path(args.data).is_dir():
        print(f"MNIST not found in {args.data}: pass --data DIR, or --quick for the digits version", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
