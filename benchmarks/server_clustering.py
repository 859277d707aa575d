"""Server clustering of client sketches: our pipeline against the reference approach.

Synthetic FEMNIST-sized sketches (default 3,550 clients x 1,240 bits, 10
groups of random prototypes, each bit flipped with P = 0.1, min_cluster_size
100 as the reference uses for FEMNIST):

1. ours: ``SketchClustering.fit`` end to end from the packed bytes (popcount
   Hamming distances, one Ward dendrogram, 35 Bayesian-optimisation probes
   that each cut it, the permutation test for one cluster);
2. the reference approach, in the same process on the same data: scikit-learn
   ``AgglomerativeClustering(n_clusters=None, distance_threshold=t,
   linkage="ward")`` refitted on the float bit vectors at each of the 35
   probes of ``skopt.gp_minimize`` with the same settings, CH from
   ``calinski_harabasz_score``, then one more fit at the chosen threshold (the
   paper's Algorithm 3, line 10). It gets our search range (its own fixed
   (1, 100) holds no admissible threshold at this scale). With
   ``--reference-probes`` below 35 the reference is timed on that many probes
   and its total estimated as 36 x the mean probe time (said in the output);
3. the Ward linkage itself two ways, each in a fresh subprocess for its peak
   memory: scipy on sqrt(Hamming) (ours) and scipy on the float bit matrix;
4. ours alone at larger client counts (default 10,000 and 30,000), each in a
   fresh subprocess that reports its peak resident memory (``VmHWM``).

Run: ``.venv/bin/python benchmarks/server_clustering.py`` (about 3 minutes;
``--quick`` for a small smoke run, ``--sizes 10000`` to choose the large
sizes). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edge_sdk import bits as _bits  # noqa: E402
from server_kit.clustering import SketchClustering  # noqa: E402


def make_sketches(
    n: int, n_bits: int, groups: int, flip_prob: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Packed sketches of ``n`` clients in ``groups`` balanced groups, and the group labels."""
    rng = np.random.default_rng(seed)
    protos = rng.integers(0, 2, size=(groups, n_bits), dtype=np.uint8)
    truth = rng.permutation(np.arange(n) % groups)
    packed = np.empty((n, (n_bits + 7) // 8), dtype=np.uint8)
    for i in range(0, n, 4096):  # in blocks: no n x n_bits float temporary
        j = min(n, i + 4096)
        flips = rng.random((j - i, n_bits)) < flip_prob
        packed[i:j] = np.packbits(protos[truth[i:j]] ^ flips, axis=1)
    return packed, truth


def vm_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmHWM``, ``VmRSS``) in KiB; 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def ari(a: np.ndarray, b: np.ndarray) -> float:
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(a, b))


# ------------------------------------------------------------ the reference


def reference_objective(x_float: np.ndarray, min_cluster_size: int, log: list[dict]):
    """The reference's probe: refit Ward on the float bits, score CH (maximised here)."""
    from sklearn.cluster import AgglomerativeClustering
    from sklearn.metrics import calinski_harabasz_score

    def objective(params: list[float]) -> float:
        t0 = time.perf_counter()
        t = float(params[0])
        labels = AgglomerativeClustering(
            n_clusters=None, distance_threshold=t, linkage="ward"
        ).fit_predict(x_float)
        sizes = np.bincount(labels)
        ok = sizes.size >= 2 and sizes.min() >= min_cluster_size
        ch = float(calinski_harabasz_score(x_float, labels)) if ok else None
        dt = time.perf_counter() - t0
        log.append({"threshold": t, "ch": ch, "n_clusters": int(sizes.size), "seconds": dt})
        print(
            f"  reference probe {len(log):2d}: t = {t:8.3f} -> k = {sizes.size:4d}"
            f"{'' if ok else ' (inadmissible)'}  {dt:.2f} s",
            flush=True,
        )
        return -ch if ok else 0.0

    return objective


def run_reference(
    packed: np.ndarray,
    n_bits: int,
    truth: np.ndarray,
    search_range: tuple[float, float],
    ours: SketchClustering,
    args: argparse.Namespace,
) -> dict:
    from sklearn.cluster import AgglomerativeClustering
    from skopt import gp_minimize
    from skopt.space import Real

    t_total = time.perf_counter()
    x_float = _bits.unpack_bits(packed, n_bits).astype(np.float64)
    log: list[dict] = []
    objective = reference_objective(x_float, args.min_cluster_size, log)
    full = args.reference_probes >= args.n_calls
    if full:
        gp_minimize(
            objective,
            [Real(*search_range, prior="log-uniform")],
            n_calls=args.n_calls,
            n_initial_points=args.n_initial_points,
            initial_point_generator="random",
            acq_func="LCB",
            acq_optimizer="sampling",
            kappa=1.96,
            random_state=args.seed,
        )
        valid = [p for p in log if p["ch"] is not None]
        if valid:
            best = max(valid, key=lambda p: p["ch"])
            t0 = time.perf_counter()
            labels = AgglomerativeClustering(
                n_clusters=None, distance_threshold=best["threshold"], linkage="ward"
            ).fit_predict(x_float)
            print(
                f"  reference final fit at t = {best['threshold']:.3f}: {time.perf_counter() - t0:.2f} s"
            )
            k, score = int(labels.max()) + 1, ari(truth, labels)
        else:
            k, score = 1, ari(truth, np.zeros_like(truth))
        seconds = time.perf_counter() - t_total
        return {"seconds": seconds, "estimated": False, "k": k, "ari": score, "probes": log}
    # Time a few probes at our optimiser's own thresholds and extrapolate.
    for probe in ours.search_[: args.reference_probes]:
        objective([probe["threshold"]])
    per_probe = statistics.mean(p["seconds"] for p in log)
    seconds = per_probe * (args.n_calls + 1)
    return {"seconds": seconds, "estimated": True, "k": None, "ari": None, "probes": log,
            "per_probe": per_probe}  # fmt: skip


# ---------------------------------------------------- subprocess workers


def worker_fit(args: argparse.Namespace) -> None:
    """Fit ours once on fresh data; print JSON with time, result and peak memory."""
    logging.basicConfig(level=logging.DEBUG, format="    [%(name)s] %(message)s", stream=sys.stderr)
    for noisy in ("matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import skopt  # noqa: F401  (imported before timing, as in the main process)

    packed, truth = make_sketches(args.worker_n, args.bits, args.groups, args.flip_prob, args.seed)
    base = vm_kib("VmRSS")
    t0 = time.perf_counter()
    model = SketchClustering(min_cluster_size=args.min_cluster_size, random_state=args.seed)
    model.fit(packed, args.bits)
    seconds = time.perf_counter() - t0
    out = {
        "n": args.worker_n, "seconds": seconds, "k": model.n_clusters_,
        "ari": ari(truth, model.labels_), "peak_kib": vm_kib("VmHWM"), "base_kib": base,
    }  # fmt: skip
    print(json.dumps(out), flush=True)


def worker_linkage(args: argparse.Namespace) -> None:
    """One Ward linkage, ours (sqrt-Hamming) or scipy on the float matrix; JSON out."""
    from scipy.cluster.hierarchy import linkage

    from server_kit.clustering import ward_linkage

    packed, _ = make_sketches(args.worker_n, args.bits, args.groups, args.flip_prob, args.seed)
    base = vm_kib("VmRSS")
    t0 = time.perf_counter()
    if args.worker_linkage == "hamming":
        z = ward_linkage(_bits.hamming_pdist(packed, args.bits))
    else:
        z = linkage(_bits.unpack_bits(packed, args.bits).astype(np.float64), method="ward")
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "peak_kib": vm_kib("VmHWM"), "base_kib": base,
           "top_height": float(z[-1, 2])}  # fmt: skip
    print(json.dumps(out), flush=True)


def spawn(args: argparse.Namespace, extra: list[str]) -> dict:
    """Run this script as a worker in a fresh process; its stderr streams through."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *extra,
           "--bits", str(args.bits), "--groups", str(args.groups),
           "--flip-prob", str(args.flip_prob), "--min-cluster-size", str(args.min_cluster_size),
           "--seed", str(args.seed)]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, cwd=REPO)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3550, help="clients of the head-to-head run")
    ap.add_argument("--bits", type=int, default=1240, help="bits per sketch (FEMNIST: 62 x 20)")
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--min-cluster-size", type=int, default=100)
    ap.add_argument("--n-calls", type=int, default=35)
    ap.add_argument("--n-initial-points", type=int, default=30)
    ap.add_argument("--reference-probes", type=int, default=35,
                    help="reference probes actually run; below --n-calls the total is estimated")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="runs of ours (median reported)")
    ap.add_argument(
        "--sizes", default="10000,30000", help="larger client counts, ours only ('' for none)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="1,000 clients, 3 reference probes (extrapolated), sizes 3000")  # fmt: skip
    ap.add_argument("--worker-n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-linkage", choices=("hamming", "float"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_n is not None:
        (worker_linkage if args.worker_linkage else worker_fit)(args)
        return 0
    if args.quick:
        args.clients, args.reference_probes, args.sizes, args.repeats = 1000, 3, "3000", 2
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    n, n_bits = args.clients, args.bits
    from scipy import __version__ as scipy_version
    from sklearn import __version__ as sklearn_version
    from skopt import __version__ as skopt_version  # imported before any timing, for both

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"numpy {np.__version__}, scipy {scipy_version}, scikit-learn {sklearn_version}, "
          f"scikit-optimize {skopt_version}, bit kernel: {_bits.BACKEND}")  # fmt: skip
    print(f"data: {n} clients x {n_bits} bits, {args.groups} groups, P = {args.flip_prob}, "
          f"min_cluster_size = {args.min_cluster_size}, {args.n_calls} probes "
          f"({args.n_initial_points} random), seed {args.seed}")  # fmt: skip
    load_start = os.getloadavg()[0]
    print(f"load average (1 min) at start: {load_start:.2f} (other processes share these cores)")
    packed, truth = make_sketches(n, n_bits, args.groups, args.flip_prob, args.seed)
    logging.basicConfig(format="    [%(name)s] %(message)s", stream=sys.stdout)
    pkg_log = logging.getLogger("server_kit.clustering")

    print(f"\n[ours: SketchClustering.fit from packed bytes, {args.repeats} runs]", flush=True)
    times = []
    for r in range(args.repeats):
        # phase timings for the last run only
        pkg_log.setLevel(logging.DEBUG if r == args.repeats - 1 else logging.WARNING)
        t0 = time.perf_counter()
        model = SketchClustering(min_cluster_size=args.min_cluster_size, random_state=args.seed)
        model.fit(packed, n_bits)
        times.append(time.perf_counter() - t0)
        print(f"  run {r + 1}: {times[-1]:.3f} s -> k = {model.n_clusters_}, "
              f"ARI {ari(truth, model.labels_):.4f}", flush=True)  # fmt: skip
    ours_s = statistics.median(times)
    ours_ari = ari(truth, model.labels_)
    low, high = model.threshold_range_
    print(f"  median {ours_s:.3f} s; threshold {model.threshold_:.2f} in [{low:.2f}, {high:.2f}], "
          f"CH {model.ch_score_:.1f} (best over every cut {model.max_ch_:.1f}), "
          f"permutation test p = {model.null_pvalue_:.3f}")  # fmt: skip

    mode = "all" if args.reference_probes >= args.n_calls else f"{args.reference_probes} of"
    print(f"\n[reference: AgglomerativeClustering refitted per probe, {mode} {args.n_calls} probes]",
          flush=True)  # fmt: skip
    ref = run_reference(packed, n_bits, truth, (low, high), model, args)
    speedup = ref["seconds"] / ours_s
    if ref["estimated"]:
        print(f"  ESTIMATE: {ref['per_probe']:.3f} s per probe x {args.n_calls + 1} "
              f"({args.n_calls} probes + the final fit) = {ref['seconds']:.1f} s")  # fmt: skip
    else:
        print(f"  total {ref['seconds']:.1f} s -> k = {ref['k']}, ARI {ref['ari']:.4f}")
    print(f"\n  ours {ours_s:.3f} s vs reference {ref['seconds']:.1f} s"
          f"{' (estimated)' if ref['estimated'] else ''}: {speedup:.1f}x faster")  # fmt: skip

    print(f"\n[Ward linkage alone, {n} clients, fresh process each]", flush=True)
    link = {}
    for how in ("hamming", "float"):
        link[how] = spawn(args, ["--worker-n", str(n), "--worker-linkage", how])
        label = (
            "scipy on sqrt(Hamming popcount)" if how == "hamming" else "scipy on float bit matrix"
        )
        print(f"  {label:34s} {link[how]['seconds']:7.3f} s, peak {link[how]['peak_kib'] / 1024:7.0f} MiB "
              f"(process before: {link[how]['base_kib'] / 1024:.0f} MiB)", flush=True)  # fmt: skip
    same_top = abs(link["hamming"]["top_height"] - link["float"]["top_height"]) < 1e-6
    print(f"  same top merge height: {same_top}")

    big = {}
    for size in sizes:
        print(f"\n[ours at {size} clients, fresh process; phase timings below]", flush=True)
        big[size] = res = spawn(args, ["--worker-n", str(size)])
        print(f"  {res['seconds']:.2f} s -> k = {res['k']}, ARI {res['ari']:.4f}, peak "
              f"{res['peak_kib'] / 1024:.0f} MiB (before fit {res['base_kib'] / 1024:.0f} MiB)",
              flush=True)  # fmt: skip

    result = {
        f"seconds_{n}": round(ours_s, 3),
        "speedup_vs_reference": round(speedup, 1),
        "reference_seconds": round(ref["seconds"], 1),
        "reference_estimated": ref["estimated"],
        f"ari_{n}": round(ours_ari, 4),
        "ari_reference": None if ref["ari"] is None else round(ref["ari"], 4),
        "k_ours": model.n_clusters_,
        "k_reference": ref["k"],
        "linkage_seconds_hamming": round(link["hamming"]["seconds"], 3),
        "linkage_seconds_float": round(link["float"]["seconds"], 3),
        "linkage_peak_mib_hamming": round(link["hamming"]["peak_kib"] / 1024),
        "linkage_peak_mib_float": round(link["float"]["peak_kib"] / 1024),
    }
    for size, res in big.items():
        result[f"seconds_{size}"] = round(res["seconds"], 2)
        result[f"peak_mib_{size}"] = round(res["peak_kib"] / 1024)
        result[f"ari_{size}"] = round(res["ari"], 4)
    load_end = os.getloadavg()[0]
    print(f"\nload average (1 min) at end: {load_end:.2f}")
    result.update({"load_start": round(load_start, 2), "load_end": round(load_end, 2)})
    result.update({"n_bits": n_bits, "groups": args.groups, "flip_prob": args.flip_prob,
                   "min_cluster_size": args.min_cluster_size, "cores": os.cpu_count()})  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
