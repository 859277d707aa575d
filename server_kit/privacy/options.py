"""The server's privacy options: ``--dp-epsilon``, ``--dp-delta``, ``--dp-clip``, ``--dp-noise``, ``--secure``."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .dp import DPFedAvg, DPSettings

__all__ = ["add_privacy_arguments", "apply_dp"]

log = logging.getLogger(__name__)


def add_privacy_arguments(p: argparse.ArgumentParser) -> None:
    """The options, in the server's parser."""
    g = p.add_argument_group("privacy (differentially private cluster models, DP-FedAvg, user level)")
    g.add_argument("--dp-epsilon", type=float, default=None, metavar="EPS",
                   help="train each cluster's model with DP-FedAvg within this epsilon (per cluster, user level): "
                        "updates clipped to --dp-clip, Gaussian noise on their sum, an accountant per cluster; a "
                        "cluster whose next round would pass it stops there (default: off)")
    g.add_argument("--dp-delta", type=float, default=1e-5, metavar="D", help="the delta of --dp-epsilon "
                   "(default: 1e-5)")
    g.add_argument("--dp-clip", type=float, default=1.0, metavar="C",
                   help="the L2 norm each device's update is clipped to, after decoding (default: 1.0)")
    g.add_argument("--dp-noise", type=float, default=None, metavar="Z",
                   help="the noise multiplier (noise standard deviation over --dp-clip); default: the smallest "
                        "that keeps --rounds rounds within --dp-epsilon, per cluster")


def apply_dp(args: argparse.Namespace, strategy: Any, rounds: int, robust: dict[str, Any]) -> None:
    """Give ``strategy`` its DP step from the options, or raise ``ValueError`` for options that do not fit."""
    if args.dp_epsilon is None:
        if args.dp_noise is not None:
            raise ValueError("--dp-noise goes with --dp-epsilon (the budget its rounds are accounted against)")
        return
    if getattr(args, "ingest_workers", None) or getattr(args, "aggregator_keys", None):
        raise ValueError("--dp-epsilon needs every update on the server (clipped one by one): not with ingest "
                         "workers or site aggregators")
    if strategy.robust.aggregator != "fedavg":
        raise ValueError(f"--dp-epsilon clips and averages every update (DP-FedAvg); --aggregator "
                         f"{strategy.robust.aggregator} has another sensitivity: use fedavg")
    if robust.get("norm_bound") is None and strategy.robust.norm_bound is not None:
        # the DP clip bounds every update already; the median screening would make one device's refusal depend
        # on the others' updates, which the accountant does not model
        strategy.robust = type(strategy.robust)(aggregator="fedavg", norm_bound=None, refuse_above=None,
                                                trim_fraction=strategy.robust.trim_fraction)
        log.info("--dp-epsilon: the DP clip (%g) bounds every update; the median norm screening is off "
                 "(--norm-bound turns it back on)", args.dp_clip)
    strategy.dp = DPFedAvg(DPSettings(epsilon=args.dp_epsilon, delta=args.dp_delta, clip=args.dp_clip,
                                      noise_multiplier=args.dp_noise, rounds=rounds))
