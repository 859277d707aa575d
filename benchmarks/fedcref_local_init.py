"""FedCRef's phase 0 alone: how pure each device's initial clusters are, by local clustering method.

The federation of ``fedcref_mnist.py`` (25 clients, 2 to 5 digits each, 500
samples per digit, ``K_i`` given), and each device's initial clustering by
every method of ``--methods`` (:func:`edge_sdk.fedcref.partition_points`:
K-means, Ward) on its raw pixels. Per method, over seeds: the mean client
accuracy (Hungarian-matched against the true digits) and the number of
impure clusters (majority digit under 80 % of the cluster). Impure clusters
are what FedCRef's association test cannot place: two devices that mixed the
same two digits associate with each other and form a community of neither
digit. Runs in seconds per seed; no training.

Run: ``.venv/bin/python benchmarks/fedcref_local_init.py [--seeds 0,1,2,3] [--quick]``
(``--quick``: scikit-learn's digits, 8 clients of 2 or 3 classes, 60 samples each).
The last line is JSON: per method ``acc``, ``acc_ci95``, ``impure`` (mean over
seeds) and ``clusters``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from _cli import csv_list, seed_list
from fedcref_mnist import DEFAULT_DATA, load_data

from edge_sdk.fedcref import POINT_METHODS
from server_kit.metrics import mean_ci


def impure_clusters(truth: np.ndarray, labels: np.ndarray, floor: float = 0.8) -> int:
    """Clusters whose most common true class holds less than ``floor`` of their samples."""
    n = 0
    for c in np.unique(labels):
        counts = np.bincount(truth[labels == c])
        n += counts.max() / counts.sum() < floor
    return int(n)


def run(args) -> dict:
    from edge_sdk.fedcref import hungarian_accuracy, partition_points
    from server_kit.fedcref import class_subset_partition

    x, y = load_data(args)
    x = x.reshape(x.shape[0], -1).astype(np.float64)
    per: dict[str, dict[str, list[float]]] = {m: {"acc": [], "impure": [], "clusters": []} for m in args.methods}
    for seed in args.seeds:
        parts = class_subset_partition(y, args.clients, classes_per_client=tuple(args.classes_per_client),
                                       samples_per_class=args.samples_per_class, seed=seed)
        line = []
        for m in args.methods:
            t0 = time.perf_counter()
            accs, impure = [], 0
            for idx, classes in parts:
                labels = partition_points(x[idx], len(classes), m, seed=seed)
                accs.append(hungarian_accuracy(y[idx], labels))
                impure += impure_clusters(y[idx], labels)
            per[m]["acc"].append(float(np.mean(accs)))
            per[m]["impure"].append(impure)
            per[m]["clusters"].append(sum(len(c) for _, c in parts))
            line.append(f"{m} {np.mean(accs):.3f} ({impure} impure, {time.perf_counter() - t0:.1f} s)")
        print(f"seed {seed}: " + ", ".join(line), flush=True)
    out = {}
    print(f"\n{'method':8s} {'client accuracy':>18s} {'impure clusters':>16s}")
    for m in args.methods:
        acc, half = mean_ci(per[m]["acc"])
        out[m] = {"acc": round(acc, 4), "acc_ci95": round(half, 4), "impure": round(float(np.mean(per[m]["impure"])), 2),
                  "clusters": round(float(np.mean(per[m]["clusters"])), 2)}
        print(f"{m:8s} {acc:11.3f} +- {half:.3f} {out[m]['impure']:9.1f} of {out[m]['clusters']:.1f}")
    out.update(seeds=args.seeds, clients=args.clients, dataset="digits" if args.quick else "mnist")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2, 3],
                    help="a count (3: seeds 0, 1, 2) or a list (0,4,7; one seed: 5,)")
    ap.add_argument("--methods", type=csv_list(str, POINT_METHODS), default=list(POINT_METHODS))
    ap.add_argument("--clients", type=int, default=25)
    ap.add_argument("--classes-per-client", type=int, nargs=2, default=[2, 5], metavar=("MIN", "MAX"))
    ap.add_argument("--samples-per-class", type=int, default=500)
    ap.add_argument("--quick", action="store_true", help="scikit-learn digits, 8 clients of 2 or 3 classes, 60 samples")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.classes_per_client, args.samples_per_class = 8, [2, 3], 60
    elif not Path(args.data).is_dir():  # pragma: no cover - needs the data folder
        print(f"MNIST not found in {args.data}: pass --data DIR, or --quick for the digits version", file=sys.stderr)
        return 2
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
