"""``fedsketch-data split``: turn a data set into one ``.npz`` per client, with the true groups.

Reads scikit-learn's digits (the default, no download), MNIST or
Fashion-MNIST from their IDX files, any MNIST-style IDX folder, or an ``.npz``
with ``x``, ``y`` (optionally ``x_test``, ``y_test``); splits it with one of
the partitioners of :mod:`server_kit.data.partition`; and writes
``OUT/<cid>.npz`` for each client (:func:`~server_kit.data.partition.save_client`:
``x``, ``y``, ``x_test``, ``y_test``, ``group``, ``cid``) and ``OUT/truth.json``
(``{"c00": 0, "c01": 1, ...}``: each client's true group). It then prints a
summary and the commands that run a federation on those files.

    fedsketch-data split --out data/clients                      # digits, 20 clients, 4 rotations
    fedsketch-data split --source mnist:../shared/data --clients 16 --groups 4 --alpha 0.5 --out mnist16
    fedsketch-data split --source local.npz --partition label-flip --clients 8 --out flip8
    python -m server_kit.data.split split --help

Bad input ends with one ``fedsketch-data: error: ...`` line and exit code 2.

This module is the command line (parser, :func:`main`); loading the source
(:mod:`server_kit.data.sources`), choosing the partition
(:mod:`server_kit.data.split_partition`) and writing the clients and the
summary (:mod:`server_kit.data.split_output`) have their own modules, whose
public names stay importable from here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import numpy as np

from server_kit.data.partition import OCFL_SPLITS
from server_kit.data.sources import (
    PROG,
    SOURCE_FORMS,
    SOURCE_KINDS,
    SPLITS,
    Source,
    SplitError,
    load_source,
    read_source,
)
from server_kit.data.split_output import split_summary, write_clients
from server_kit.data.split_partition import (
    DEFAULT_DIRICHLET_ALPHA,
    DEFAULT_GROUPS,
    DEFAULT_OCFL_SPLIT,
    PARTITIONS,
    check_applicable,
    partition,
)

__all__ = ["PARTITIONS", "SOURCE_KINDS", "Source", "build_parser", "load_source", "main", "partition", "write_clients"]

_VERIFY = {"yes": True, "no": False, "strict": "strict"}


# --------------------------------------------------------------------------- command line


_SPLIT_DESCRIPTION = """\
Split a data set into one .npz per client (x, y, x_test, y_test, group, cid) and
truth.json ({"c00": 0, ...}: each client's true group), then print a summary and
the commands that run a federation on those files.

examples:
  fedsketch-data split --out data/clients         # digits, 20 clients, 4 rotation groups
  fedsketch-data split --source mnist:../shared/data --clients 16 --groups 4 --alpha 0.5 --out mnist16
  fedsketch-data split --source local.npz --partition label-flip --clients 8 --out flip8
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except for options that are unset (None) or flags (False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line as one ``fedsketch-data: error: ...`` line (no usage dump), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def _class_sets(text: str) -> list[list[int]]:
    sets = [s for s in text.replace(";", "/").split("/") if s.strip()]
    if not sets:
        raise argparse.ArgumentTypeError(f"expected class sets like 0,1,2,3/4,5,6/7,8,9, got {text!r}")
    return [_int_list(s) for s in sets]


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (np.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v


def _add_split_options(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("data set")
    src.add_argument("--source", default="digits", metavar="SOURCE",
                     help=f"the data set: {SOURCE_FORMS}. digits is scikit-learn's 1,797 8x8 digits "
                          "(no download); MNIST-style folders hold train-images-idx3-ubyte[.gz] etc.")
    src.add_argument("--split", choices=SPLITS, default="train",
                     help="which part of the source to partition (all: train and test together)")
    src.add_argument("--verify", choices=list(_VERIFY), default="yes",
                     help="check IDX .gz files against the published MNIST / Fashion-MNIST sha256 "
                          "(strict: refuse files with no known hash)")
    src.add_argument("--max-samples", type=_positive_int, default=None, metavar="N",
                     help="use a random subset of N samples (default: all)")

    part = p.add_argument_group("partition")
    part.add_argument("--partition", choices=list(PARTITIONS), default="rotation",
                      help="; ".join(f"{k}: {v}" for k, v in PARTITIONS.items()))
    part.add_argument("--clients", type=_positive_int, default=20, metavar="N", help="number of clients")
    part.add_argument("--groups", type=_positive_int, default=None, metavar="G",
                      help=f"groups of rotation (1-4), label-flip and uneven (default: {DEFAULT_GROUPS})")
    part.add_argument("--group-sizes", type=_int_list, default=None, metavar="S0,S1,...",
                      help="clients per group, in contiguous blocks (must sum to --clients)")
    part.add_argument("--group-shares", type=_float_list, default=None, metavar="W0,W1,...",
                      help="share of the clients per group, summing to 1 (uneven, class-sets)")
    part.add_argument("--alpha", type=_positive_float, default=None, metavar="A",
                      help="Dirichlet(A) label skew (small A: few classes per client); unset: equal "
                           f"random shards (dirichlet: {DEFAULT_DIRICHLET_ALPHA})")
    part.add_argument("--num-classes", type=_positive_int, default=None, metavar="C",
                      help="number of classes (default: largest label + 1)")
    part.add_argument("--class-sets", type=_class_sets, default=None, metavar="0,1,2,3/4,5,6/...",
                      help="the classes of each group (class-sets, pathological)")
    part.add_argument("--overlapping", action="store_const", const=True, default=None,
                      help="class-sets: the groups share classes (default sets: the OCFL overlapping ones)")
    part.add_argument("--ocfl-split", choices=list(OCFL_SPLITS), default=None,
                      help=f"ocfl: which of the paper's splits (default: {DEFAULT_OCFL_SPLIT})")
    part.add_argument("--classes-per-client", type=_positive_int, default=None, metavar="K",
                      help="pathological: classes each client draws (default: 2)")
    part.add_argument("--samples-per-client", type=_positive_int, default=None, metavar="N",
                      help="class-sets, ocfl: exactly N samples per client (default: all samples dealt out)")
    part.add_argument("--min-size", type=_positive_int, default=10, metavar="N",
                      help="every client gets at least N samples (train + test)")
    part.add_argument("--test-fraction", type=_fraction, default=0.2, metavar="F",
                      help="share of each client's samples kept as its x_test, y_test")
    part.add_argument("--seed", type=int, default=0, help="seed of the shards and of --max-samples")

    out = p.add_argument_group("output")
    out.add_argument("--out", required=True, metavar="DIR",
                     help="folder for <client id>.npz (x, y, x_test, y_test, group, cid) and truth.json")
    out.add_argument("--overwrite", action="store_true",
                     help="write into a folder that already holds client files (and remove the stale ones)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedsketch-data`` parser, with its ``split`` command."""
    p = _Parser(prog=PROG, description="Data sets for a FedSketch federation.",
                formatter_class=_HelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    split = sub.add_parser("split", formatter_class=_HelpFormatter, description=_SPLIT_DESCRIPTION,
                           help="write one .npz per client and truth.json from a data set")
    _add_split_options(split)
    return p


def run_split(args: argparse.Namespace) -> int:
    """The ``split`` command on parsed arguments; raises ``SplitError`` or ``ValueError`` on bad input."""
    check_applicable(args)
    if args.partition == "pathological" and args.classes_per_client is None:
        args.classes_per_client = 2
    source = read_source(args.source, args.split, _VERIFY[args.verify], args.max_samples, args.seed)
    clients = partition(source, args)
    truth = write_clients(clients, args.out, overwrite=args.overwrite)
    print(split_summary(source, clients, args, truth))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fedsketch-data`` (and ``python -m server_kit.data.split``); returns the exit code.

    ``split`` may be left out: options alone (``fedsketch-data --out DIR``) mean ``split``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "split")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse's own errors (exit 2, usage + one error line) and --help (0)
        return int(e.code or 0)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_split(args)
    except (SplitError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
