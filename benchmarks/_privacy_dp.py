"""DP-FedAvg per cluster on the paper's scenario: accuracy against epsilon, and the clients it would take.

Imported by ``privacy.py`` (its ``dp`` part). Every run is ours (sketch clustering, then FedAvg per cluster) in
the in-process simulator, with the same clients and seed; the first is not private (its own FedAvg, sample
weighted), then one run per epsilon (``server_kit.privacy.dp``: each update clipped to ``--dp-clip`` after
decoding, equal weights, Gaussian noise on each cluster's sum, the noise fitted so that ``--rounds`` rounds
spend the budget at ``--dp-delta``; user level, per cluster).

The cohort question: with ``m`` devices asked per cluster round the noise on the mean is ``z clip / m``. A
cluster that asks ``M`` devices a round at the same sampling rate needs the same ``z`` for the same epsilon, so
its noise on the mean is ``z clip / M``. We run our ``m`` devices with the noise multiplier ``z m / M`` (the
mean's noise of an ``M`` cohort) and report the smallest ``M`` whose accuracy comes within the tolerance of the
non-private run: an extrapolation that keeps our devices' clipped mean as the signal, stated as such.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from paper_mnist import architecture_of, build_clients


def scenario(args: argparse.Namespace) -> argparse.Namespace:
    """The paper's MNIST scenario (or digits with ``--quick``), as ``paper_mnist.build_clients`` takes it."""
    return argparse.Namespace(dataset="digits" if args.quick else "mnist", data=args.data, seed=args.dp_seed,
                              clients=12 if args.quick else 100, alpha=0.0 if args.quick else 10.0,
                              test_set="held-out" if args.quick else "mnist-test")


def run_one(args: argparse.Namespace, clients: list, dp: Any) -> dict[str, Any]:
    """One run of ours with ``dp`` (None: not private); its accuracies, accountant and seconds."""
    from edge_sdk import OnnxEncoder
    from edge_sdk.tasks import TrainSettings
    from server_kit.drivers.simulate import Simulator
    from server_kit.privacy.dp import DPFedAvg
    from server_kit.strategies.fedsketch import SketchClustered

    ns = scenario(args)
    settings = TrainSettings(epochs=args.dp_epochs, lr=args.dp_lr, batch_size=32)
    strategy = SketchClustered(settings=settings, fraction=args.dp_fraction, seed=ns.seed,
                               min_cluster_size=max(3, ns.clients // 10), norm_bound=None, refuse_above=None)
    strategy.dp = None if dp is None else DPFedAvg(dp)
    encoder = OnnxEncoder("digits_encoder" if args.quick else "fmnist_fc_encoder")
    t0 = time.perf_counter()
    res = Simulator(strategy, clients, architecture=architecture_of(ns), encoder=encoder, seed=ns.seed,
                    progress=False).run(args.dp_rounds)
    lost = [r.report.round for r in res.rounds if r.report.updates != r.report.tasked]
    if lost:
        raise RuntimeError(f"rounds with updates lost: {lost}")
    accs = res.accuracies
    return {"accuracy": accs, "final": accs[-1], "ari": res.ari, "seconds": time.perf_counter() - t0,
            "dp": res.privacy.get("dp"),
            "norm_median": [r.report.summary.get("norm_median") for r in res.rounds]}


def _job(args: argparse.Namespace, label: str, dp: Any) -> tuple[str, dict[str, Any]]:
    """One run in a worker process (one torch thread): its label and row."""
    import torch

    torch.set_num_threads(1)
    return label, run_one(args, build_clients(scenario(args)), dp)


def run_all(args: argparse.Namespace, jobs: list[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every (label, DP settings) run, ``--jobs`` at a time, each printed as it ends."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    rows: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_job, args, label, dp) for label, dp in jobs]
        for f in as_completed(futures):
            label, row = f.result()
            rows[label] = row
            print(f"  {label:>22}: accuracy {row['final']:.4f} after {len(row['accuracy'])} rounds, ARI "
                  f"{row['ari']:.3f} ({row['seconds']:.0f} s)", flush=True)
    return rows


def dp_part(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep: not private, each epsilon, and the cohorts at ``--dp-cohort-epsilon``, ``--jobs`` at a time."""
    from server_kit.privacy.accountant import noise_for_budget
    from server_kit.privacy.dp import DPSettings

    per_cluster = scenario(args).clients // 4
    m = max(1, math.ceil(args.dp_fraction * per_cluster))
    q = m / per_cluster
    z8 = noise_for_budget(args.dp_cohort_epsilon, args.dp_delta, args.dp_rounds, q)
    jobs: list[tuple[str, Any]] = [("not private", None)]
    jobs += [(f"epsilon {e:g}", DPSettings(epsilon=e, delta=args.dp_delta, clip=args.dp_clip, rounds=args.dp_rounds,
                                           noise_seed=args.dp_seed)) for e in args.dp_epsilons]
    jobs += [(f"cohort {b}", DPSettings(epsilon=1e12, delta=args.dp_delta, clip=args.dp_clip, rounds=args.dp_rounds,
                                        noise_multiplier=z8 * m / b, noise_seed=args.dp_seed)) for b in args.dp_cohorts]
    rows = run_all(args, jobs)
    base = rows["not private"]
    by_eps = {}
    for e in args.dp_epsilons:
        row = rows[f"epsilon {e:g}"]
        clusters = row["dp"]["clusters"].values()
        by_eps[f"{e:g}"] = {**row, "epsilon_spent": max(c["epsilon"] for c in clusters),
                            "noise_multiplier": max(c["noise_multiplier"] for c in clusters),
                            "clipped_share": sum(c["clipped"] for c in clusters) / max(1, sum(
                                c["rounds"] * c["per_round"] for c in clusters))}
    cohorts = {str(b): {"final": rows[f"cohort {b}"]["final"], "accuracy": rows[f"cohort {b}"]["accuracy"],
                        "clients_needed": 4 * round(b / q)} for b in args.dp_cohorts}
    within = [int(b) for b, c in cohorts.items() if base["final"] - c["final"] <= args.dp_tolerance]
    at = by_eps.get(f"{args.dp_cohort_epsilon:g}")
    return {"not_private": base, "by_epsilon": by_eps, "cohorts": cohorts, "per_round": m, "sampling_rate": q,
            "delta": args.dp_delta, "clip": args.dp_clip, "rounds": args.dp_rounds,
            "cohort_epsilon": args.dp_cohort_epsilon, "cohort_noise_multiplier": z8,
            "gap_at_cohort_epsilon": None if at is None else base["final"] - at["final"],
            "clients_needed": 4 * round(min(within) / q) if within else None}


def plot_dp(res: dict[str, Any], path: Any) -> None:
    """Accuracy against epsilon (log axis), the non-private run as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(res["by_epsilon"], key=float)
    eps, acc = [float(k) for k in keys], [res["by_epsilon"][k]["final"] for k in keys]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(eps, acc, "o-", label=f"DP-FedAvg per cluster (delta {res['delta']:g}, {res['per_round']} devices a "
                                  "cluster round)")
    ax.axhline(res["not_private"]["final"], color="grey", ls="--", label="not private")
    for i, (big, c) in enumerate(sorted(res["cohorts"].items(), key=lambda kv: int(kv[0]))):
        x = res["cohort_epsilon"] * (1 + 0.08 * (i - 1))  # side by side: they may land on the same accuracy
        ax.plot([x], [c["final"]], "s", label=f"epsilon {res['cohort_epsilon']:g} as if {big} devices a round "
                                              f"({c['clients_needed']} clients): {c['final']:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon per cluster (user level)")
    ax.set_ylabel(f"mean test accuracy after {res['rounds']} rounds")
    ax.set_title("Differentially private cluster models")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
