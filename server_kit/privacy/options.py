"""The server's privacy options: ``--dp-epsilon``, ``--dp-delta``, ``--dp-clip``, ``--dp-noise``, ``--secure``."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..strategies.capabilities import partials_refusal
from .dp import DPFedAvg, DPSettings
from .secure_sum import SecureSettings

__all__ = ["add_privacy_arguments", "apply_dp", "secure_settings"]

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
                   help="the noise multiplier (noise standard deviation over --dp-clip) (default: the smallest "
                        "that keeps --rounds rounds within --dp-epsilon, per cluster)")
    s = p.add_argument_group("secure aggregation (the server learns each cluster's sum, never one device's update)")
    s.add_argument("--secure", action="store_true",
                   help="sum each cluster's round by secure aggregation: devices mask their quantised updates with "
                        "pairwise masks (X25519) and Shamir-shared seeds; the sum survives devices that drop; the "
                        "server screens no single update (default: off)")
    s.add_argument("--secure-bits", type=int, default=SecureSettings.bits, metavar="B",
                   help=f"bits per value of a masked update before the sum (default: {SecureSettings.bits})")
    s.add_argument("--secure-clip", type=float, default=None, metavar="C",
                   help=f"the L2 norm each device clips its update to before quantising (default: --dp-clip with "
                        f"--dp-epsilon, else {SecureSettings.clip:g})")


def apply_dp(args: argparse.Namespace, strategy: Any, rounds: int, robust: dict[str, Any]) -> None:
    """Give ``strategy`` its DP step from the options, or raise ``ValueError`` for options that do not fit."""
    if args.dp_epsilon is None:
        if args.dp_noise is not None:
            raise ValueError("--dp-noise goes with --dp-epsilon (the budget its rounds are accounted against)")
        return
    if getattr(args, "ingest_workers", None) or getattr(args, "aggregator_keys", None):
        raise ValueError("--dp-epsilon needs every update on the server (clipped one by one): not with ingest "
                         "workers or site aggregators")
    if getattr(strategy, "shared_prefixes", ()):
        raise ValueError("--dp-epsilon accounts each cluster on its own; --shared-base averages layers over every "
                         "cluster, which that accounting does not cover: leave --shared-base out")
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


def secure_settings(args: argparse.Namespace, strategy: Any) -> SecureSettings | None:
    """``--secure``'s settings, or None; ``ValueError`` for a run it cannot serve."""
    if not args.secure:
        if args.secure_clip is not None:
            raise ValueError("--secure-clip goes with --secure")
        return None
    if getattr(args, "ingest_workers", None) or getattr(args, "aggregator_keys", None):
        raise ValueError("--secure sums on the server: not with ingest workers or site aggregators")
    if strategy.capabilities.devices_choose_model:
        raise ValueError(f"--secure sums one model's updates per group: --strategy {strategy.name} lets each device "
                         "choose among several")
    why = partials_refusal(strategy.capabilities, strategy.robust.aggregator)
    if why:
        raise ValueError(f"--secure gives the strategy one sum per cluster, and --strategy {strategy.name} cannot "
                         f"take it: {why}")
    clip = args.secure_clip if args.secure_clip is not None else (
        args.dp_clip if args.dp_epsilon is not None else SecureSettings.clip)
    if args.dp_epsilon is not None and clip != args.dp_clip:
        raise ValueError(f"--secure-clip {clip:g} and --dp-clip {args.dp_clip:g}: with both, the devices clip to the "
                         "DP clip (leave --secure-clip out)")
    if strategy.robust.norm_bound is not None:
        log.info("--secure: the server sees no single update to screen; the devices' clip (%g) bounds each one",
                 clip)
        strategy.robust = type(strategy.robust)(aggregator="fedavg", norm_bound=None, refuse_above=None,
                                                trim_fraction=strategy.robust.trim_fraction)
    return SecureSettings(bits=args.secure_bits, clip=clip)
