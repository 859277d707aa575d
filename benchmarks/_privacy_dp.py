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
                               min_cluster_size=max(3, ns.clients // 10))
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
            "dp": res.privacy.get("dp")}


def dp_part(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep: not private, then each epsilon, then the cohorts at ``--dp-cohort-epsilon``."""
    from server_kit.privacy.accountant import noise_for_budget
    from server_kit.privacy.dp import DPSettings

    clients = build_clients(scenario(args))
    per_cluster = len(clients) // 4
    m = max(1, math.ceil(args.dp_fraction * per_cluster))
    q = m / per_cluster
    base = run_one(args, clients, None)
    print(f"  not private: accuracy {base['final']:.4f} after {args.dp_rounds} rounds ({base['seconds']:.0f} s)",
          flush=True)
    rows = {}
    for eps in args.dp_epsilons:
        s = DPSettings(epsilon=eps, delta=args.dp_delta, clip=args.dp_clip, rounds=args.dp_rounds,
                       noise_seed=args.dp_seed)
        row = run_one(args, clients, s)
        spent = max(c["epsilon"] for c in row["dp"]["clusters"].values())
        z = next(iter(row["dp"]["clusters"].values()))["noise_multiplier"]
        rows[f"{eps:g}"] = {**row, "epsilon_spent": spent, "noise_multiplier": z}
        print(f"  epsilon {eps:>5g}: accuracy {row['final']:.4f} (noise multiplier {z:.3f}, epsilon spent "
              f"{spent:.3f} per cluster, {row['seconds']:.0f} s)", flush=True)
    z8 = noise_for_budget(args.dp_cohort_epsilon, args.dp_delta, args.dp_rounds, q)
    cohorts = {}
    for big in args.dp_cohorts:
        s = DPSettings(epsilon=1e12, delta=args.dp_delta, clip=args.dp_clip, rounds=args.dp_rounds,
                       noise_multiplier=z8 * m / big, noise_seed=args.dp_seed)
        row = run_one(args, clients, s)
        cohorts[str(big)] = {"final": row["final"], "accuracy": row["accuracy"], "clients_needed": 4 * round(big / q)}
        print(f"  epsilon {args.dp_cohort_epsilon:g} with {big} devices a cluster round ({4 * round(big / q)} "
              f"clients in all): accuracy {row['final']:.4f}", flush=True)
    within = [int(b) for b, c in cohorts.items() if base["final"] - c["final"] <= args.dp_tolerance]
    at = rows.get(f"{args.dp_cohort_epsilon:g}")
    return {"not_private": base, "by_epsilon": rows, "cohorts": cohorts, "per_round": m, "sampling_rate": q,
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
    for big, c in sorted(res["cohorts"].items(), key=lambda kv: int(kv[0])):
        ax.plot([res["cohort_epsilon"]], [c["final"]], "s", label=f"epsilon {res['cohort_epsilon']:g} with "
                                                                  f"{big} devices a round ({c['clients_needed']} clients)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon per cluster (user level)")
    ax.set_ylabel(f"mean test accuracy after {res['rounds']} rounds")
    ax.set_title("Differentially private cluster models")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
