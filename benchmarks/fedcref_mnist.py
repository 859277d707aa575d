"""FedCRef on MNIST: unsupervised federated clustering against the paper's EMNIST figures.

Nardi, Valerio and Passarella, "Federated Clustering: An Unsupervised
Cluster-Wise Training for Decentralized Data Distributions", Table 4 and
Fig. 8 (EMNIST digits, which we do not have: MNIST is the closest). The
paper's default federation: 25 clients, each holding 2 to 5 of the 10 digit
classes, 500 unlabelled samples of each, no sample on two clients; alpha =
75, theta = 0.2, tau = 0.8; one 784-100-64-32 autoencoder per local cluster
(Adam, MSE, 20 epochs); 15 FedAvg rounds per community; stop when the
numbers of communities and isolated clusters stay within 10 % for 3
iterations or no client is active.

Local initial clustering (``--init``): ``ward`` (default), Ward's
hierarchical clustering on the raw pixels with ``K_i`` given, as the paper
gives it (``--estimate-k``: silhouette over 2..5); the paper used DEC here.
``kmeans``: K-means on the same points, 0.81 initial accuracy against Ward's
0.85, with a third more impure clusters (``fedcref_local_init.py``).
``--encoder fmnist_fc_encoder`` clusters the latent codes of the shipped
Fashion-MNIST encoder (784 -> 20, run by every client with ONNX Runtime)
instead of pixels: poorer features for digits (0.67 with K-means).
``dirty``: the paper's simulated initialisation (``--dirtiness``).
The baseline clusters the same data centrally: K-means with K = 10 on the
same latent codes, scored by Hungarian accuracy over all samples
(``central_kmeans_acc``) and, like FedCRef, per client
(``central_kmeans_client_acc``).

Per seed it records: initial and final clustering accuracy (mean over
clients of the Hungarian-matched accuracy against the true digits),
communities found (against the digits held by at least two clients, and
against 10), wrong associations (edges of the last association graph joining
clusters whose majority digits differ, in % of its edges, as the paper, and
as a count), isolated clusters at the start (every local cluster, as the
paper counts it), after the first association test and at the end,
iterations, bytes on the wire (every object through the real FedSketch
envelope, one delivery per recipient, 1 MB chunks), wall time. Over seeds:
mean and 95 % confidence interval (Student t). With ``--export`` the first
seed's community models are exported to ONNX and label the MNIST images no
client holds with ONNX Runtime alone (``onnx_heldout_acc``).

MNIST's train and test splits are pooled (70,000 images) so that 25 clients
x 3.5 classes x 500 samples rarely ask more of a digit than exists; a draw
that does is redrawn (:func:`server_kit.fedcref.class_subset_partition`).

``--quick`` runs on scikit-learn's 8x8 digits (no data folder needed; Ward on pixels too): 8
clients with 2 or 3 classes, 60 samples each, the 64-48-32-16 autoencoder
(60 epochs, batch 16), theta 0.3, 5 community rounds of 2 epochs, 2 seeds.

Run: ``.venv/bin/python benchmarks/fedcref_mnist.py [--seeds 0,1,2 --clients 25] [--jobs 2]``.
It uses one torch thread per process (``--jobs``: seeds side by side in
separate processes, the same results as one process). Output: a table, ``reports/fedcref_mnist/results.json``,
``trends.png`` (per-iteration means with 95 % bands) and a last line of JSON
with ``initial_acc``, ``final_acc``, ``communities``, ``wrong_associations``,
``central_kmeans_acc``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _cli import seed_list

from edge_sdk.fedcref import INIT_METHODS
from server_kit.metrics import mean_ci

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"
#: The paper's Table 4 (EMNIST digits, DEC initialisation, 25 clients, 5 runs, mean and 95 % CI).
PAPER = {
    "initial_acc": "0.781 +- 0.045",
    "final_acc": "0.894 +- 0.031",
    "communities": "10.8 +- 1.1 (of 10)",
    "wrong_associations": "1.1 +- 1.6 %",
    "isolated_start": "87.5 +- 3.2",
    "isolated_end": "19.1 +- 7.2",
    "iterations": "11.5 (20 clients) / 13.7 (30), Table 12",
    "central_kmeans_acc": "0.793 +- 0.087 (central DEC, best K)",
    "wall_seconds": "50 / 71 min (20 / 30 clients), Table 12",
}
METRICS = [
    ("initial_acc", "initial accuracy", "{:.3f}"),
    ("final_acc", "final accuracy", "{:.3f}"),
    ("communities", "communities found", "{:.1f}"),
    ("classes_shared", "digits held by >= 2 clients", "{:.1f}"),
    ("classes_covered", "digits with a community", "{:.1f}"),
    ("wrong_associations", "wrong associations (% of edges)", "{:.1f}"),
    ("wrong_association_edges", "wrong associations (edges)", "{:.1f}"),
    ("isolated_start", "isolated clusters at start (all)", "{:.1f}"),
    ("isolated_first", "isolated after 1st association", "{:.1f}"),
    ("isolated_end", "isolated clusters at end", "{:.1f}"),
    ("iterations", "iterations", "{:.1f}"),
    ("final_global_acc", "FedCRef global accuracy", "{:.3f}"),
    ("central_kmeans_acc", "central K-means (K=10) accuracy", "{:.3f}"),
    ("central_kmeans_client_acc", "central K-means, per client", "{:.3f}"),
    ("bytes_total", "bytes on the wire (MB)", "{:.1f}"),
    ("wall_seconds", "wall time (s)", "{:.0f}"),
]


def load_data(args) -> tuple[np.ndarray, np.ndarray]:
    if args.quick:
        from server_kit.data.partition import load_digits_images

        return load_digits_images()
    from server_kit.data.idx import load_mnist

    xs, ys = zip(*(load_mnist(args.data, split) for split in ("train", "test")))
    return np.concatenate(xs), np.concatenate(ys)


def run_seed(seed: int, x: np.ndarray, y: np.ndarray, args, encoder, export_dir: Path | None) -> dict[str, Any]:
    from sklearn.cluster import KMeans

    from edge_sdk.fedcref import FedCRefClient, hungarian_accuracy
    from server_kit.fedcref import class_subset_partition, run_fedcref

    parts = class_subset_partition(y, args.clients, classes_per_client=tuple(args.classes_per_client),
                                   samples_per_class=args.samples_per_class, seed=seed)
    holders = np.bincount(np.concatenate([list(s) for _, s in parts]), minlength=10)
    clients, truth = [], []
    for i, (idx, classes) in enumerate(parts):
        clients.append(FedCRefClient(
            f"c{i:02d}", x[idx], n_clusters=None if args.estimate_k else len(classes),
            k_range=tuple(args.classes_per_client), init=args.init, encoder=encoder, true_labels=y[idx],
            dirtiness=args.dirtiness, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
            community_epochs=args.community_epochs, alpha=args.alpha, normalization=args.normalization,
            link_communities=args.link_communities, own_models=args.own_models, init_seed=seed, seed=seed * 1000 + i, threads=1,
        ))
        truth.append(y[idx])
    t0 = time.perf_counter()
    res = run_fedcref(clients, true_labels=truth, theta=args.theta, tau=args.tau,
                      community_rounds=args.community_rounds, max_iterations=args.max_iterations, seed=seed,
                      merge_communities=args.merge_communities,
                      export_dir=export_dir, progress=args.progress)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "seed": seed,
        "clients": len(clients),
        "class_sets": [list(s) for _, s in parts],
        "initial_acc": res.initial_acc,
        "final_acc": res.final_acc,
        "communities": len(res.communities),
        "classes_shared": int((holders >= 2).sum()),
        "classes_covered": res.history[-1].get("classes_covered"),
        "wrong_associations": res.wrong_association_pct,
        "wrong_association_edges": res.wrong_associations,
        "isolated_start": res.clusters_start,
        "isolated_first": res.isolated_first,
        "isolated_end": res.history[-1]["isolated"],
        "iterations": res.iterations,
        "stopped": res.stopped,
        "bytes_total": res.bytes_total / 1e6,
        "bytes_by_kind": res.ledger.as_dict(),
        "wall_seconds": wall,
        "client_train_seconds": float(sum(c.train_seconds_ for c in clients)),
        "client_eval_seconds": float(sum(c.error_table_.seconds for c in clients)),
        "history": [{k: v for k, v in h.items() if k not in ("stability", "client_acc")} for h in res.history],
        "client_acc_final": res.history[-1].get("client_acc"),
    }
    # FedCRef's global labels over all samples; each isolated cluster counts as its own category
    glob = []
    for c in clients:
        g = res.global_labels[c.cid].copy()
        g[g < 0] = -1 - c.labels_[g < 0] - 100 * int(c.cid[1:])
        glob.append(g)
    all_t = np.concatenate(truth)
    # each final community's majority digit, its clusters and the share of its samples of that digit
    g_all = np.concatenate([res.global_labels[c.cid] for c in clients])
    row["community_digits"] = []
    for g, members in enumerate(res.communities):
        digits = all_t[g_all == g]
        if digits.size:
            counts = np.bincount(digits, minlength=10)
            row["community_digits"].append([int(counts.argmax()), len(members), round(counts.max() / digits.size, 3)])
    row["digits_split"] = res.history[-1]["audit"]["classes_split"]  # digits spread over communities
    row["final_global_acc"] = hungarian_accuracy(all_t, np.concatenate(glob))
    # the baseline: the same samples clustered centrally, K-means (K = 10) on the same latent codes
    if all(c.latents_ is not None for c in clients):
        z = np.concatenate([c.latents_ for c in clients])
    else:  # the dirty init computes no latents: encode here
        z = np.concatenate([encoder.encode(c.x) if encoder is not None else c.x for c in clients])
    km = KMeans(n_clusters=int(len(np.unique(all_t))), n_init=10, random_state=seed).fit_predict(z)
    row["central_kmeans_acc"] = hungarian_accuracy(all_t, km)
    bounds = np.cumsum([0] + [len(t) for t in truth])
    row["central_kmeans_client_acc"] = float(np.mean([hungarian_accuracy(truth[i], km[bounds[i]:bounds[i + 1]])
                                                      for i in range(len(truth))]))
    if export_dir is not None and res.exported:
        from edge_sdk.fedcref import OnnxCommunityLabeler

        used = np.zeros(len(y), dtype=bool)
        used[np.concatenate([idx for idx, _ in parts])] = True
        # the digit each community stands for: the majority digit of the samples it labels
        covered = sorted({int(np.bincount(all_t[g_all == g]).argmax()) for g in np.unique(g_all[g_all >= 0])})
        held_out = ~used & np.isin(y, covered)
        labeler = OnnxCommunityLabeler(export_dir)
        pred = labeler.predict(x[held_out].reshape(int(held_out.sum()), -1))
        row["onnx_heldout_acc"] = hungarian_accuracy(y[held_out], pred)
        row["onnx_heldout_samples"] = int(held_out.sum())
        row["onnx_files"] = [p.name for p in res.exported]
        row["onnx_bytes"] = int(sum(p.stat().st_size for p in res.exported))
    return row


def _seed_worker(seed: int, args, export: bool) -> dict[str, Any]:
    """One seed in its own process (``--jobs``): its own data, encoder and torch thread."""
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s [seed {seed}] %(name)s: %(message)s", force=True)
    x, y = load_data(args)
    return run_seed(seed, x, y, args, make_encoder(args), Path(args.out) / "onnx" if export else None)


def make_encoder(args):
    """The ONNX encoder whose latents the initial clustering runs on (None: pixels)."""
    from edge_sdk.encoder import OnnxEncoder

    return None if args.encoder == "none" else OnnxEncoder(args.encoder, threads=1)


def print_seed(row: dict[str, Any]) -> None:
    print(f"  seed {row['seed']}: acc {row['initial_acc']:.3f} -> {row['final_acc']:.3f}, {row['communities']} "
          f"communities ({row['classes_shared']} digits shared, {row['digits_split']} split), wrong "
          f"{row['wrong_association_edges']} edges, isolated {row['isolated_start']} -> {row['isolated_end']}, "
          f"{row['iterations']} iterations ({row['stopped']}), {row['bytes_total']:.0f} MB, "
          f"{row['wall_seconds']:.0f} s (clients: {row['client_train_seconds']:.0f} s training, "
          f"{row['client_eval_seconds']:.0f} s evaluating); central K-means {row['central_kmeans_acc']:.3f}", flush=True)


def run_rows(args, out: Path) -> list[dict[str, Any]]:
    """One row per seed, in one process or (``--jobs`` above 1) in several, each of which loads the data
    and the encoder; the first seed exports."""
    if args.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        print(f"threads: {args.jobs} processes, each with 1 torch thread", file=sys.stderr, flush=True)
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_seed_worker, seed, args, args.export and k == 0) for k, seed in enumerate(args.seeds)]
            rows = []
            for f in futures:
                rows.append(f.result())
                print_seed(rows[-1])
            return rows
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    x, y = load_data(args)
    encoder = make_encoder(args)
    seeds = tqdm(args.seeds, desc="seeds", disable=not args.progress) if tqdm else args.seeds
    rows = []
    for k, seed in enumerate(seeds):
        rows.append(run_seed(seed, x, y, args, encoder, out / "onnx" if args.export and k == 0 else None))
        print_seed(rows[-1])
    return rows


def plot_trends(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [("acc", "mean client accuracy"), ("communities", "communities"), ("isolated", "isolated clusters"),
              ("wrong_pct", "wrong associations (% edges)"), ("active", "active clients"),
              ("bytes_total", "bytes on the wire (GB, cumulative)")]
    longest = max(len(r["history"]) for r in rows)
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (key, label) in zip(axes.ravel(), panels):
        series = []
        for r in rows:
            vals = []
            for h in r["history"]:
                if key == "wrong_pct":
                    vals.append(100.0 * h.get("wrong", 0) / h["edges"] if h["edges"] else 0.0)
                elif key == "bytes_total":
                    vals.append(h["bytes_total"] / 1e9)
                else:
                    vals.append(h.get(key, float("nan")))
            series.append(vals + [vals[-1]] * (longest - len(vals)))  # a stopped run keeps its last value
        arr = np.asarray(series, dtype=np.float64)
        its = np.arange(1, longest + 1)
        stats = [mean_ci(list(arr[:, j])) for j in range(longest)]
        mean = np.array([s[0] for s in stats])
        half = np.array([s[1] for s in stats])
        if key == "acc":
            init = np.mean([r["initial_acc"] for r in rows])
            its, mean, half = np.concatenate([[0], its]), np.concatenate([[init], mean]), np.concatenate([[0], half])
        if key == "active":
            start = np.mean([r["clients"] for r in rows])
            its, mean, half = np.concatenate([[0], its]), np.concatenate([[start], mean]), np.concatenate([[0], half])
        if key == "isolated":
            start = np.mean([r["isolated_start"] for r in rows])
            its, mean, half = np.concatenate([[0], its]), np.concatenate([[start], mean]), np.concatenate([[0], half])
        lo, hi = (0.0, 1.0) if key == "acc" else (0.0, 100.0) if key == "wrong_pct" else (0.0, np.inf)
        ax.plot(its, mean, marker="o", ms=3)
        ax.fill_between(its, np.clip(mean - half, lo, hi), np.clip(mean + half, lo, hi), alpha=0.25)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if key == "communities":
            ax.axhline(10, color="grey", ls="--", lw=1, label="10 digits")
            ax.axhline(np.mean([r["classes_shared"] for r in rows]), color="grey", ls=":", lw=1,
                       label="digits held by >= 2 clients")
            ax.legend(fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> dict[str, Any]:
    from server_kit.report import write_json

    t_all = time.perf_counter()
    print(f"FedCRef on {'digits (8x8)' if args.quick else 'MNIST'}: {args.clients} clients x "
          f"{args.classes_per_client[0]}-{args.classes_per_client[1]} classes x {args.samples_per_class} samples, "
          f"init {args.init}{' (K estimated)' if args.estimate_k else ''} on "
          f"{'pixels' if args.encoder == 'none' else args.encoder + ' latents'}, alpha {args.alpha}, theta {args.theta}, "
          f"tau {args.tau}, {args.normalization} differences, AE epochs {args.epochs}, "
          f"{args.community_rounds} community rounds, seeds {args.seeds}, {args.jobs} process(es)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_rows(args, out)
    summary = {key: mean_ci([r.get(key) for r in rows]) for key, _, _ in METRICS}
    print(f"\n{'metric':36s} {'ours (mean +- 95% CI)':>24s}   paper (EMNIST, Table 4)")
    for key, label, fmt in METRICS:
        m, h = summary[key]
        print(f"{label:36s} {fmt.format(m) + ' +- ' + fmt.format(h):>24s}   {PAPER.get(key, '')}")
    if "onnx_heldout_acc" in rows[0]:
        print(f"\nONNX Runtime labelling of {rows[0]['onnx_heldout_samples']} held-out images of the digits "
              f"that have a community, with the {len(rows[0]['onnx_files'])} community models ({rows[0]['onnx_bytes'] / 1e6:.1f} "
              f"MB): accuracy {rows[0]['onnx_heldout_acc']:.3f}")
    plot_trends(out / "trends.png", rows, f"FedCRef on {'digits' if args.quick else 'MNIST'}, {args.clients} "
                f"clients, {len(rows)} seed(s): mean and 95 % CI per iteration, clipped to possible values")
    seconds = time.perf_counter() - t_all
    write_json(out / "results.json", {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                      "paper": PAPER, "rows": rows,
                                      "summary": {k: {"mean": m, "ci95": h} for k, (m, h) in summary.items()},
                                      "seconds": seconds})
    print(f"\nreport: {out}/results.json, {out}/trends.png; {seconds:.0f} s in all")
    final = {
        "initial_acc": round(summary["initial_acc"][0], 4),
        "final_acc": round(summary["final_acc"][0], 4),
        "communities": round(summary["communities"][0], 2),
        "wrong_associations": round(summary["wrong_associations"][0], 2),
        "central_kmeans_acc": round(summary["central_kmeans_acc"][0], 4),
        "initial_acc_ci95": round(summary["initial_acc"][1], 4),
        "final_acc_ci95": round(summary["final_acc"][1], 4),
        "communities_ci95": round(summary["communities"][1], 2),
        "classes_shared": round(summary["classes_shared"][0], 2),
        "wrong_association_edges": round(summary["wrong_association_edges"][0], 2),
        "isolated_start": round(summary["isolated_start"][0], 2),
        "isolated_end": round(summary["isolated_end"][0], 2),
        "iterations": round(summary["iterations"][0], 2),
        "bytes_total_mb": round(summary["bytes_total"][0], 1),
        "wall_seconds": round(summary["wall_seconds"][0], 1),
        "central_kmeans_client_acc": round(summary["central_kmeans_client_acc"][0], 4),
        "final_global_acc": round(summary["final_global_acc"][0], 4),
        "seeds": len(rows), "clients": args.clients, "dataset": "digits" if args.quick else "mnist",
    }
    if "onnx_heldout_acc" in rows[0]:
        final["onnx_heldout_acc"] = round(rows[0]["onnx_heldout_acc"], 4)
    return final


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--seeds", type=seed_list, default=[0, 1, 2], help="a count (3: seeds 0,1,2) or a list (0,4,7; one seed: 5,)")
    ap.add_argument("--clients", type=int, default=25)
    ap.add_argument("--classes-per-client", type=int, nargs=2, default=[2, 5], metavar=("MIN", "MAX"))
    ap.add_argument("--samples-per-class", type=int, default=500)
    ap.add_argument("--init", choices=[m for m in INIT_METHODS if m != "given"], default="ward",
                    help="the devices' initial clustering: K-means or Ward's hierarchical clustering on pixels "
                         "(or --encoder latents), or the paper's simulated dirty labels")
    ap.add_argument("--encoder", default="none",
                    help="ONNX encoder whose latents K-means (and the baseline) cluster; 'none': raw pixels "
                         "(default: none; digits_encoder: the shipped digits encoder; fmnist_fc_encoder: the shipped "
                         "Fashion-MNIST encoder)")
    ap.add_argument("--estimate-k", action="store_true", help="choose K_i by silhouette (default: given)")
    ap.add_argument("--dirtiness", type=float, default=0.3)
    ap.add_argument("--alpha", type=float, default=75.0)
    ap.add_argument("--theta", type=float, default=0.2)
    ap.add_argument("--tau", type=float, default=0.8)
    ap.add_argument("--normalization", choices=["relative", "minmax"], default="relative")
    ap.add_argument("--no-link-communities", dest="link_communities", action="store_false",
                    help="refine with every model a separate candidate (the paper's Algorithm 2 verbatim)")
    ap.add_argument("--publish-adopted", dest="own_models", action="store_false",
                    help="a device publishes the community model its refinement chose as that cluster's model "
                         "(default: it retrains on its own cluster, Algorithm 1 line 8)")
    ap.add_argument("--no-merge-communities", dest="merge_communities", action="store_false",
                    help="no community check: communities are the association graph's components alone "
                         "(the paper's Algorithm 1)")
    ap.add_argument("--epochs", type=int, default=20, help="local epochs of each cluster autoencoder")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--community-rounds", type=int, default=15)
    ap.add_argument("--community-epochs", type=int, default=1)
    ap.add_argument("--max-iterations", type=int, default=30)
    ap.add_argument("--export", action=argparse.BooleanOptionalAction, default=True,
                    help="export the first seed's community models to ONNX and label held-out images")
    ap.add_argument("--out", default="reports/fedcref_mnist")
    ap.add_argument("--quick", action="store_true", help="scikit-learn digits, 8 clients, 2 seeds")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--jobs", type=int, default=1, help="seeds side by side in this many processes")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.quick:
        args.clients, args.classes_per_client, args.samples_per_class = 8, [2, 3], 60
        args.epochs, args.batch_size, args.theta = 60, 16, 0.3
        args.community_rounds, args.community_epochs, args.max_iterations = 5, 2, 8
        args.seeds = args.seeds if args.seeds != [0, 1, 2] else [0, 1]
        args.out = args.out if args.out != "reports/fedcref_mnist" else "reports/fedcref_quick"
    elif not Path(args.data).is_dir():  # pragma: no cover - needs the data folder
        print(f"MNIST not found in {args.data}: pass --data DIR, or --quick for the digits version",
              file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # a shared 2-core machine: more threads are slower
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
