"""The ``fedsketch export`` command line (also ``python -m server_kit.export``)."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from edge_sdk.models.artifacts import MANIFEST_NAME

from ..cli_options import device_name
from .recipes import DEFAULT_EPOCHS, TARGETS, export_target

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The ``fedsketch export`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fedsketch export",
        description="Train and export the shipped ONNX/safetensors artifacts and update manifest.json.",
    )
    p.add_argument("target", choices=[*TARGETS, "all"], help="what to build")
    p.add_argument(
        "--data",
        default=None,
        help="Fashion-MNIST IDX folder (fmnist-fc-ae; with 'all' it applies to fmnist-fc-ae only)",
    )
    p.add_argument("--out", default="models", help="output folder (default: models)")
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"training epochs of the trained targets (defaults: {DEFAULT_EPOCHS})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--device", type=device_name, default="cpu",
                   help="where the autoencoders train: cpu, cuda or auto (CUDA when torch sees it); the shipped "
                        "files are trained on the CPU, a GPU's weights differ in their last bits (default: cpu)")
    p.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    return p


def _run_targets(args: argparse.Namespace) -> list[tuple[str, dict[str, dict[str, Any]], float]]:
    """Build every requested target; return (target, entries, seconds) per target."""
    targets = TARGETS if args.target == "all" else (args.target,)
    if "fmnist-fc-ae" in targets and args.data is None:
        raise ValueError("fmnist-fc-ae needs --data DIR (the Fashion-MNIST IDX folder)")
    if args.epochs is not None and args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    done = []
    for target in targets:
        data = args.data if target == "fmnist-fc-ae" or args.target != "all" else None
        t0 = time.perf_counter()
        entries = export_target(
            target,
            args.out,
            data=data,
            epochs=args.epochs if target in DEFAULT_EPOCHS else None,
            seed=args.seed,
            out_arg=args.out,
            data_arg=data,
            device=args.device,
        )
        seconds = time.perf_counter() - t0
        logger.info("%s done in %.1f s", target, seconds)
        done.append((target, entries, seconds))
    return done


def _summary(done: Sequence[tuple[str, Mapping[str, Mapping[str, Any]], float]], out: str) -> str:
    """Human-readable table of what was written."""
    lines = [f"artifacts written to {out}/ ({MANIFEST_NAME} updated):"]
    for target, entries, seconds in done:
        lines.append(f"  {target} ({seconds:.1f} s)")
        for _name, e in sorted(entries.items()):
            mse = "".join(f" {k}={e[k]:.5f}" for k in ("train_mse", "test_mse") if k in e)
            lines.append(
                f"    {e['file']:<24} {e['role']:<11} in={e['input_shape']} "
                f"params={e['params']}{mse} sha256={e['sha256'][:12]}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m server_kit.export`` and ``fedsketch export``.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success, 2 on a usage or data error.
    """
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=getattr(logging, str(args.log_level).upper(), logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        done = _run_targets(args)
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    print(_summary(done, args.out))
    return 0
