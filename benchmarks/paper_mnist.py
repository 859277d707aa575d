"""The paper's MNIST comparison, side by side in one run (Prigent et al., Tables III and IV).

Five methods on the same clients, seeds and training settings, in the
in-process simulator (the same strategy and client code as the MQTT
orchestrator): ours with the centrally pre-trained autoencoder (the shipped
Fashion-MNIST one), ours with federated AE pre-training (FedAvg of the AE over
the clients, exported to ONNX, then sketches), IFCA (K = 4, on-device ONNX
selection), LADD (FFT-amplitude features, K-means with K = 4) and FedAvg.

The paper's scenario (the defaults): MNIST from ``--data``, 100 clients,
Dirichlet alpha = 10 label skew, client i rotated by 90 * (i mod 4) degrees
(train and test), 50 clients per round, LeNet-5 (its two convolutions averaged
over all sampled clients, the rest per cluster, as in the reference), Adam
1e-3, batch 32, 5 local epochs, 50 rounds, P = 0.1, plain FedAvg (no norm
clipping: ``--robust`` turns on FedSketch's default clipping).

Test sets (``--test-set``): ``mnist-test`` (default, the paper's protocol as
its reference code runs it) trains each client on its whole shard of MNIST's
60,000 training images (about 600) and tests it on its own Dirichlet shard of
MNIST's 10,000 test images (about 100), rotated as its training images.
``held-out`` keeps 20 % of each training shard as its test set (about 480 to
train, 120 to test). The accuracy of a round is the mean over the clients
trained that round of their cluster model's accuracy on their test set; the
final accuracy is the mean of the last 5 rounds. ``--seeds 3`` runs seeds 0, 1,
2 and reports each method's mean with its 95 % Student-t interval.

``--quick`` runs a small version on scikit-learn's digits (no data folder
needed; it is the smoke test of ``make test``). Bytes are counted per client
delivery from the real wire encoding (see :mod:`server_kit.metrics`).

Run: ``.venv/bin/python benchmarks/paper_mnist.py [--rounds R --clients N --epochs E] [--jobs 2]``
(``--jobs``: methods side by side in separate processes, one torch thread each).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _cli import add_device_options, seed_list

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"
METHODS = ("ours-central", "ours-federated", "ifca", "ladd", "fedavg")
PAPER = {  # Table III / IV of the paper (MNIST): rounds to 95 %, final accuracy (%)
    "ours-central": (5, 98.35), "ours-federated": (5, 98.49), "ifca": (11, 97.50),
    "ladd": (40, 94.16), "fedavg": (None, 93.05),
}
# relative cost per round on MNIST (measured): the order in which --jobs starts them
COST = {"ifca": 1.3, "ours-federated": 1.1, "ladd": 1.0, "ours-central": 1.0, "fedavg": 0.9}


def build_clients(args):
    """The clients of the run: rotation groups over MNIST (or digits), with the test set of ``--test-set``."""
    from server_kit.data.partition import ClientData, load_digits_images, rotation_groups

    skew = dict(alpha=args.alpha, min_size=10) if args.alpha else {}
    if args.dataset == "digits":
        images, labels = load_digits_images()
        return rotation_groups(images, labels, args.clients, groups=4, seed=args.seed, **skew)
    from server_kit.data.idx import load_mnist

    images, labels = load_mnist(args.data, "train")
    if args.test_set == "held-out":
        return rotation_groups(images, labels, args.clients, groups=4, seed=args.seed, **skew)
    train = rotation_groups(images, labels, args.clients, groups=4, seed=args.seed, test_fraction=0.0, **skew)
    test_x, test_y = load_mnist(args.data, "test")
    # an independent draw over the test images; client i is in group i mod 4 in both
    test = rotation_groups(test_x, test_y, args.clients, groups=4, seed=args.seed + 10_000, test_fraction=0.0,
                           **skew)
    return [ClientData(tr.cid, tr.x_train, tr.y_train, te.x_train, te.y_train, tr.group)
            for tr, te in zip(train, test)]


def make_method(name, args, clients, arch, tmp):
    """(strategy, encoder, extra) for a method; extra holds the pre-training phase's costs."""
    from edge_sdk import OnnxEncoder
    from edge_sdk.tasks import TrainSettings
    from edge_sdk.training.nets import BASE_LAYERS
    from server_kit.strategies.fedavg import FedAvg
    from server_kit.strategies.fedsketch import SketchClustered
    from server_kit.strategies.ifca import IFCA
    from server_kit.strategies.ladd import LADD

    settings = TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size)
    common = dict(settings=settings, fraction=args.fraction, seed=args.seed)
    if not args.robust:  # the paper's plain FedAvg
        common.update(norm_bound=None, refuse_above=None)
    shared = dict(shared_prefixes=BASE_LAYERS.get(arch, ())) if args.shared_base else {}
    extra = {"pretrain_seconds": 0.0, "pretrain_bytes": 0}
    if name == "fedavg":
        return FedAvg(**common), None, extra
    if name == "ifca":
        return IFCA(k=4, architecture=arch, **common), None, extra
    if name == "ladd":
        return LADD(k=4, **shared, **common), None, extra
    mcs = max(3, args.clients // 10)  # the paper: 10 for 100 clients
    strategy = SketchClustered(min_cluster_size=mcs, clustering=args.clustering, **shared, **common)
    if name == "ours-central":
        return strategy, OnnxEncoder(args.central_encoder), extra
    from server_kit.pretrain import export_encoder, federated_ae_pretrain

    t0 = time.perf_counter()
    pre = federated_ae_pretrain([c.x_train for c in clients], architecture=args.ae_architecture,
                                rounds=args.ae_rounds, clients_per_round=min(args.ae_clients, len(clients)),
                                epochs=args.ae_epochs, seed=args.seed, progress=args.progress and args.jobs == 1,
                                device=args.device)
    exported = export_encoder(pre.weights, args.ae_architecture, tmp, name="fed_ae_encoder")
    onnx_bytes = exported.nbytes  # the encoder each client receives
    extra["pretrain_seconds"] = time.perf_counter() - t0
    extra["pretrain_bytes"] = int(pre.bytes_down + pre.bytes_up + onnx_bytes * len(clients))
    return strategy, OnnxEncoder("fed_ae_encoder", models_dir=tmp), extra


def run_method(name, args, clients, arch, tmp) -> dict:
    """Run one method on ``clients``; the row of the results table (plain JSON types)."""
    from server_kit.drivers.simulate import Simulator
    from server_kit.metrics import final_accuracy, rounds_to_target

    t0 = time.perf_counter()
    strategy, encoder, extra = make_method(name, args, clients, arch, tmp)
    sim = Simulator(strategy, clients, architecture=arch, encoder=encoder, flip_prob=args.flip_prob,
                    seed=args.seed, progress=args.progress and args.jobs == 1,
                    device=args.device, batched=args.batched, step=args.step)
    res = sim.run(args.rounds)
    accs = res.accuracies
    total = res.total_bytes() + extra["pretrain_bytes"]
    row = {
        "accuracy": accs, "rounds_to_target": rounds_to_target(accs, args.target), "final_acc": final_accuracy(accs),
        **res.scores, "bytes": total, "bytes_by_kind": res.ledger.as_dict(),
        "bytes_per_round": [r.bytes_total for r in res.rounds],
        "pretrain_bytes": extra["pretrain_bytes"], "seconds_pretrain": extra["pretrain_seconds"],
        "seconds_clustering": res.seconds_clustering, "seconds_training": res.seconds_training,
        "seconds": time.perf_counter() - t0, "clusters": len(set(res.assignment.values())),
    }
    print(f"  {name:15s} seed {args.seed}: final {row['final_acc']:.4f}  to {args.target:.0%}: {row['rounds_to_target'] or 'never'}  "
          f"ARI {res.scores['ari']:.3f}  {total / 1e6:9.1f} MB  {row['seconds']:.1f} s", flush=True)
    return row


def _set_threads(threads) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _worker(name: str, args) -> dict:
    """One method in its own process (``--jobs``): its own data, torch threads and temporary folder."""
    _set_threads(args.threads)
    # force: a pooled process runs several methods, each line says which
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [{name}] %(message)s", datefmt="%H:%M:%S",
                        force=True)
    if args.progress:  # one log line per round instead of a progress bar per process
        logging.getLogger("server_kit.drivers.simulate").setLevel(logging.INFO)
    arch = architecture_of(args)
    with tempfile.TemporaryDirectory(prefix=f"fedsketch-paper-{name}-") as tmp:
        return run_method(name, args, build_clients(args), arch, tmp)


def architecture_of(args) -> str:
    return "digits_cnn_1x8x8_10" if args.dataset == "digits" else "lenet5_1x28x28_10"


def run_seeds(args) -> list[dict[str, dict]]:
    """Every method of ``args.methods`` on every seed of ``args.seeds``: per seed, its rows by method.

    With ``--jobs`` above 1 every (seed, method) pair runs in its own process, the slowest methods first.
    """
    arch = architecture_of(args)
    for seed in args.seeds:
        print(f"seed {seed}: {args.clients} clients ({args.dataset}, test set {args.test_set}), 4 rotation groups, "
              f"{args.rounds} rounds x {args.epochs} epochs, fraction {args.fraction}, P = {args.flip_prob}, "
              f"architecture {arch}, {'robust' if args.robust else 'plain'} FedAvg, {args.jobs} process(es)",
              flush=True)
    if args.jobs == 1:
        runs = []
        for seed in args.seeds:
            one = _with_seed(args, seed)
            clients = build_clients(one)
            with tempfile.TemporaryDirectory(prefix="fedsketch-paper-") as tmp:
                runs.append({name: run_method(name, one, clients, arch, tmp) for name in args.methods})
        return runs
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    tasks = sorted(((seed, name) for seed in args.seeds for name in args.methods), key=lambda t: -COST[t[1]])
    # spawn: a fresh interpreter per worker (no forked torch thread pools)
    print(f"threads: {args.jobs} processes, each with {args.threads or 'torch default'} torch thread(s)",
          file=sys.stderr, flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {(seed, name): pool.submit(_worker, name, _with_seed(args, seed))
                   for seed, name in tasks}
        return [{name: futures[seed, name].result() for name in args.methods} for seed in args.seeds]


def _with_seed(args, seed: int) -> argparse.Namespace:
    """A copy of ``args`` for one seed's run."""
    return argparse.Namespace(**{**vars(args), "seed": seed})


def summarize(runs: list[dict[str, dict]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per method, the mean and 95 % interval over seeds of its final accuracy, rounds to target, ARI and bytes.

    Rounds to target is NaN when a seed never reached the target (not the mean of those that did).
    """
    from server_kit.metrics import mean_ci

    def over_seeds(name: str, key: str) -> tuple[float, float]:
        values = [rows[name][key] for rows in runs]
        if key == "rounds_to_target" and None in values:
            return float("nan"), float("nan")
        return mean_ci(values)

    keys = ("final_acc", "rounds_to_target", "ari", "ami", "bytes")
    return {name: {k: over_seeds(name, k) for k in keys} for name in runs[0]}


def _print_table(args, runs: list[dict[str, dict]], stats: dict[str, dict[str, tuple[float, float]]]) -> None:
    ours = stats.get("ours-central") or stats.get("ours-federated")
    pm = "+-" if len(runs) > 1 else ""
    print(f"\n{'method':16s} {'rounds to ' + format(args.target, '.0%'):>13s} {'final acc':>17s} {'ARI':>6s} "
          f"{'AMI':>6s} {'MB':>9s} {'x ours':>7s} | paper: rounds, final %   ({len(runs)} seed(s): mean"
          f"{' +- 95 % CI' if pm else ''})")
    for name, st in stats.items():
        ratio = st["bytes"][0] / ours["bytes"][0] if ours else float("nan")
        never = np.isnan(st["rounds_to_target"][0])  # some seed never reached the target
        rounds = "never" if never else f"{st['rounds_to_target'][0]:.1f}"
        acc = f"{st['final_acc'][0]:.4f}" + (f" +- {st['final_acc'][1]:.4f}" if pm else "")
        pr = PAPER.get(name, (None, None))
        print(f"{name:16s} {rounds:>13s} {acc:>17s} {st['ari'][0]:6.3f} {st['ami'][0]:6.3f} "
              f"{st['bytes'][0] / 1e6:9.1f} {ratio:7.2f} | {pr[0] or 'never'}, {pr[1]}")


def run(args) -> dict:
    """Every seed of ``args.seeds``; print the table; the summary dict (means over seeds)."""
    from server_kit.report import plot_accuracy, write_json

    _set_threads(args.threads)
    t_all = time.perf_counter()
    runs = run_seeds(args)
    stats = summarize(runs)
    _print_table(args, runs, stats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {n: [float(v) for v in np.mean([rows[n]["accuracy"] for rows in runs], axis=0)] for n in stats}
    plot_accuracy(out / "accuracy.png", curves,
                  title=f"{args.dataset}: mean local test accuracy per round ({args.clients} clients, "
                        f"{len(runs)} seed(s))")
    seconds = time.perf_counter() - t_all
    write_json(out / "results.json", {"args": vars(args), "runs": [{"seed": s, "rows": r} for s, r in
                                                                   zip(args.seeds, runs)],
                                      "summary": stats, "seconds": seconds})

    def mean(name: str, key: str, digits: int | None = 4) -> float | None:
        """The mean over seeds (None for a method not run, or rounds to target that some seed never reached)."""
        if name not in stats or np.isnan(stats[name][key][0]):
            return None
        return stats[name][key][0] if digits is None else round(stats[name][key][0], digits)

    def ci(name: str, key: str) -> float | None:
        return None if mean(name, key) is None else round(stats[name][key][1], 4)

    ours = stats.get("ours-central") or stats.get("ours-federated")
    summary = {
        "ours_rounds_to_95": mean("ours-central", "rounds_to_target", 2),
        "ours_final_acc": mean("ours-central", "final_acc"),
        "ours_final_acc_ci95": ci("ours-central", "final_acc"),
        "ours_final_acc_seeds": ([round(rows["ours-central"]["final_acc"], 4) for rows in runs]
                                 if "ours-central" in stats else None),
        "ours_ari": mean("ours-central", "ari", None),
        "ours_federated_final_acc": mean("ours-federated", "final_acc"),
        "ours_federated_final_acc_ci95": ci("ours-federated", "final_acc"),
        "ours_federated_rounds_to_95": mean("ours-federated", "rounds_to_target", 2),
        "ours_federated_ari": mean("ours-federated", "ari", None),
        "ifca_bytes_over_ours": (round(stats["ifca"]["bytes"][0] / ours["bytes"][0], 3)
                                 if "ifca" in stats and ours else None),
        # per round once training runs, whatever the rounds run: IFCA sends every changed model of its K = 4
        "ifca_round_bytes_over_ours": (round(float(np.mean([round_bytes(rows["ifca"]["bytes_per_round"]) / round_bytes(rows[o]["bytes_per_round"])
                                                            for rows in runs])), 3)
                                       if "ifca" in stats and (o := _ours_name(stats)) else None),
        "models_down_per_update": {n: round(float(np.mean([models_per_update(rows[n]["bytes_by_kind"]) for rows in runs])), 3)
                                   for n in stats},
        "ifca_final_acc": mean("ifca", "final_acc"),
        "ladd_ari": mean("ladd", "ari", None),
        "fedavg_final_acc": mean("fedavg", "final_acc"),
        "rounds": args.rounds, "clients": args.clients, "epochs": args.epochs, "seeds": args.seeds,
        "test_set": args.test_set, "robust": args.robust, "dataset": args.dataset, "seconds": round(seconds, 1),
    }
    print(f"\nreport: {out}/results.json, {out}/accuracy.png; {seconds:.0f} s in all")
    return summary


def _ours_name(stats: dict) -> str | None:
    return next((n for n in ("ours-central", "ours-federated") if n in stats), None)


def round_bytes(cumulative: list[int]) -> float:
    """Bytes a round moves once training runs, from the ledger's total after each round: the rounds after the
    first, whose first models and sketches go once. What a codec or a method costs per round, whatever the round
    a run reaches its target in."""
    return (cumulative[-1] - cumulative[0]) / (len(cumulative) - 1) if len(cumulative) > 1 else float(cumulative[-1])


def models_per_update(by_kind: dict) -> float:
    """Models sent down per update sent up (a ledger's ``as_dict()``): 1 for one model per device, up to K for IFCA."""
    return by_kind["down"]["MODEL"]["messages"] / by_kind["up"]["UPDATE"]["messages"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_options(ap)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.5, help="clients per round (of each cluster)")
    ap.add_argument("--alpha", type=float, default=10.0, help="Dirichlet label skew (0: equal shards)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--seeds", type=seed_list, default=[0],
                    help="a count (3: seeds 0, 1, 2) or a list (0,4,7; one seed: 5,); mean and 95 %% interval "
                         "over them")
    ap.add_argument("--test-set", choices=["mnist-test", "held-out"], default="mnist-test",
                    help="each client's test set: its shard of MNIST's test images (the paper's protocol) or 20 %% "
                         "of its training shard (digits: always held-out)")
    ap.add_argument("--robust", action="store_true",
                    help="FedSketch's default norm clipping (the paper: plain FedAvg)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-shared-base", dest="shared_base", action="store_false",
                    help="average every layer per cluster (default: convolutions over all clients)")
    ap.add_argument("--central-encoder", default=None)
    ap.add_argument("--ae-architecture", default=None)
    ap.add_argument("--ae-rounds", type=int, default=10)
    ap.add_argument("--ae-clients", type=int, default=50)
    ap.add_argument("--ae-epochs", type=int, default=3)
    ap.add_argument("--out", default="reports/paper_mnist")
    ap.add_argument("--quick", action="store_true", help="digits, 12 clients, 3 rounds: the smoke test")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice); 1 on a shared machine, where more threads "
                         "than free cores slow LeNet-5 training by orders of magnitude")
    ap.add_argument("--jobs", type=int, default=1,
                    help="methods run side by side in this many processes (each with --threads, default 1, "
                         "torch threads); same seeds and results as one process")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs > 1 and args.threads is None:
        args.threads = 1
    args.clustering = {}
    if args.quick:
        args.test_set = "held-out"
        args.dataset, args.clients, args.epochs = "digits", 12, 3
        args.rounds = args.rounds if args.rounds != ap.get_default("rounds") else 3  # --rounds given: kept
        args.fraction, args.alpha, args.lr, args.batch_size = 1.0, 0.0, 1e-2, 16
        args.ae_rounds, args.ae_clients, args.ae_epochs = 4, 12, 3
        # 12 clients make at most 11 cuts: 10 random threshold probes find the best as 35 do
        args.clustering = {"n_calls": 10, "n_initial_points": 10}
        args.progress = False
        args.out = args.out if args.out != "reports/paper_mnist" else "reports/paper_quick"
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if args.central_encoder is None:
        args.central_encoder = "digits_encoder" if args.dataset == "digits" else "fmnist_fc_encoder"
    if args.ae_architecture is None:
        args.ae_architecture = "fc_ae_64_48_20" if args.dataset == "digits" else "fc_ae_784_50_20"
    if args.dataset == "mnist" and not Path(args.data).is_dir():
        print(f"MNIST not found in {args.data}: pass --data DIR, or --quick for the digits version",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
