"""The default codec pair on the ResNet-18 path: its accuracy and rounds against whole float32 models.

The project ships three trained model kinds: the demo's digits CNN and MNIST's
LeNet-5 (both measured by ``compression.py``: ``--quick`` and the full run)
and ResNet-18 for 32x32x3 images (11.2 M parameters, BatchNorm with its
running statistics and integer counters). No 32x32x3 data set ships here, so
this script trains ResNet-18 on MNIST padded to 32x32 and repeated on three
channels: ``--clients`` devices of one group (FedAvg; nothing to cluster),
each with ``--train`` training images and ``--test`` images of MNIST's test
split, Adam 1e-3, batch 32, ``--epochs`` local epochs, every device every
round, in the in-process simulator, which counts the real encoded bodies both
ways.

For each seed it runs whole models (``none/none``) and the servers' default
pair (``fedsketch-server``'s ``--compress-up`` and ``--compress-down``
defaults), then any ``--combos``. It checks that every round summed every
update it tasked before it reports bytes. Reported per pair: accuracy per
round, the first round at ``--target``, the final accuracy and the bytes, and
the default's final accuracy against none's (mean over the seeds, the largest
drop of one seed).

Run: ``.venv/bin/python benchmarks/compression_resnet.py --jobs 2`` (about 14 min on 2 cores for 2 seeds).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_mnist import DEFAULT_DATA  # noqa: E402

ARCH = "resnet18_3x32x32_10"


def build_clients(args, seed: int) -> list:
    """MNIST padded to 32x32x3: ``args.clients`` devices, disjoint training and test draws per seed."""
    from server_kit.data.clients import ClientData
    from server_kit.data.idx import load_mnist

    rng = np.random.default_rng(seed)
    xs, ys = load_mnist(args.data, "train")
    xt, yt = load_mnist(args.data, "test")
    tr = rng.permutation(len(ys))[: args.clients * args.train].reshape(args.clients, args.train)
    te = rng.permutation(len(yt))[: args.clients * args.test].reshape(args.clients, args.test)

    def pad(a: np.ndarray) -> np.ndarray:
        return np.repeat(np.pad(a, ((0, 0), (2, 2), (2, 2)))[:, None], 3, axis=1).astype(np.float32)

    return [ClientData(f"c{i:02d}", pad(xs[tr[i]]), ys[tr[i]].astype(np.int64), pad(xt[te[i]]),
                       yt[te[i]].astype(np.int64), 0) for i in range(args.clients)]


def run_one(combo: str, seed: int, args) -> dict:
    """One run of FedAvg with ``combo`` (up/down) on ``seed``'s devices."""
    import torch

    from edge_sdk.tasks import TrainSettings
    from server_kit.drivers.simulate import Simulator
    from server_kit.strategies.fedavg import FedAvg

    torch.set_num_threads(args.threads)
    up, _, down = combo.partition("/")
    t0 = time.perf_counter()
    s = FedAvg(settings=TrainSettings(epochs=args.epochs, lr=1e-3, batch_size=32), fraction=1.0, seed=seed,
               compress_up=up, compress_down=down)
    res = Simulator(s, build_clients(args, seed), architecture=ARCH, seed=seed).run(args.rounds)
    lost = [(r.report.round, r.report.tasked, r.report.updates) for r in res.rounds
            if r.report.updates != r.report.tasked]
    if lost:
        raise RuntimeError(f"{combo} seed {seed}: rounds with updates lost (round, tasked, summed): {lost}")
    accs = [round(float(a), 4) for a in res.accuracies]
    first = next((i + 1 for i, a in enumerate(accs) if a >= args.target), None)
    row = {"combo": combo, "seed": seed, "accuracy": accs, "final_acc": accs[-1], "rounds_to_target": first,
           "bytes_up": int(res.ledger.total("up", ["UPDATE"])), "bytes_down": int(res.ledger.total("down", ["MODEL"])),
           "total_bytes": int(res.total_bytes()), "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  {combo:14s} seed {seed}: accuracy {accs}, {args.target:.0%} in round {first}, "
          f"{row['total_bytes'] / 1e6:.1f} MB, {row['seconds']:.0f} s", flush=True)
    return row


def run_all(jobs: list[tuple[str, int]], args) -> dict[tuple[str, int], dict]:
    if args.jobs == 1:
        return {job: run_one(*job, args) for job in jobs}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    print(f"threads: {args.jobs} processes, each with {args.threads} torch thread(s)", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = {job: pool.submit(run_one, *job, args) for job in jobs}
        return {job: f.result() for job, f in futures.items()}


def main(argv=None) -> int:
    from server_kit.cli_options import DEFAULT_COMPRESS_DOWN, DEFAULT_COMPRESS_UP

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--train", type=int, default=384, help="training images per device")
    ap.add_argument("--test", type=int, default=200, help="test images per device (MNIST's test split)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds (draws of images, initial model)")
    ap.add_argument("--combos", default="", help="more up/down pairs beside none/none and the default")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side in this many processes")
    ap.add_argument("--out", default="reports/compression_resnet")
    args = ap.parse_args(argv)
    default = f"{DEFAULT_COMPRESS_UP}/{DEFAULT_COMPRESS_DOWN}"
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    combos = list(dict.fromkeys(["none/none", default] + [c.strip() for c in args.combos.split(",") if c.strip()]))
    bad = [c for c in combos if c.count("/") != 1]
    if bad or not seeds or min(args.clients, args.train, args.test, args.rounds, args.epochs, args.jobs) < 1:
        ap.error(f"--combos are up/down pairs, got {bad}" if bad else
                 "--seeds, --clients, --train, --test, --rounds, --epochs and --jobs must be positive")
    from edge_sdk.compress import Compression
    from edge_sdk.compress.update_codec import check_compression_pair

    for c in combos:
        try:
            check_compression_pair(*(Compression.parse(x) for x in c.split("/")), "compression_resnet.py")
        except ValueError as e:
            ap.error(f"--combos {c}: {e}")
    if not Path(args.data).is_dir():
        print(f"MNIST not found in {args.data}: pass --data DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(f"ResNet-18 (11.2 M parameters) on MNIST padded to 3x32x32: {args.clients} devices x {args.train} "
          f"images, {args.rounds} rounds x {args.epochs} epoch(s), seeds {seeds}; {', '.join(combos)} "
          f"(default {default})", flush=True)
    t0 = time.perf_counter()
    done = run_all([(c, s) for c in combos for s in seeds], args)
    rows = {c: [done[(c, s)] for s in seeds] for c in combos}
    none, dflt = rows["none/none"], rows[default]
    drops = [n["final_acc"] - d["final_acc"] for n, d in zip(none, dflt)]
    summary = {
        "architecture": ARCH, "seeds": seeds, "default": default, "target": args.target,
        "final_acc": {c: round(float(np.mean([r["final_acc"] for r in v])), 4) for c, v in rows.items()},
        "rounds_to_target": {c: [r["rounds_to_target"] for r in v] for c, v in rows.items()},
        "bytes_over_none": {c: round(float(np.mean([n["total_bytes"] / r["total_bytes"] for n, r in zip(none, v)])), 2)
                            for c, v in rows.items()},
        "default_acc_minus_none": round(-float(np.mean(drops)), 4) + 0.0,  # no -0.0
        "default_worst_seed_drop": round(float(max(drops)), 4) + 0.0,
        "default_in_none_rounds": all(n["rounds_to_target"] is None or (d["rounds_to_target"] is not None and
                                                                        d["rounds_to_target"] <= n["rounds_to_target"])
                                      for n, d in zip(none, dflt)),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                  "runs": rows, "summary": summary}, indent=1))
    print(f"\n{'pair':14s} {'final accuracy (mean)':>22s} {'rounds to target':>18s} {'fewer bytes':>12s}")
    for c in combos:
        print(f"{c:14s} {summary['final_acc'][c]:22.4f} {str(summary['rounds_to_target'][c]):>18s} "
              f"{summary['bytes_over_none'][c]:11.2f}x")
    print(f"default {default}: {summary['default_acc_minus_none'] * 100:+.2f} points against whole models "
          f"(worst seed {0.0 - summary['default_worst_seed_drop'] * 100:+.2f}), in none's rounds on every seed: "
          f"{summary['default_in_none_rounds']}; report {out}/results.json")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
