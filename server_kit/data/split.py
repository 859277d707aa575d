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
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server_kit.data.idx import load_fashion_mnist, load_idx_dataset, load_mnist
from server_kit.data.partition import (
    OCFL_CLASS_SETS,
    OCFL_SPLITS,
    ClientData,
    class_set_groups,
    group_sizes_from_shares,
    label_flip_groups,
    load_digits_images,
    pathological_partition,
    rotation_groups,
    save_client,
)

__all__ = ["PARTITIONS", "SOURCE_KINDS", "Source", "build_parser", "load_source", "main", "partition", "write_clients"]

logger = logging.getLogger(__name__)

PROG = "fedsketch-data"

#: ``--partition`` choices and what each does.
PARTITIONS: dict[str, str] = {
    "rotation": "client i in group i mod G, its images rotated by 90*group degrees",
    "label-flip": "client i in group k = i mod G, its labels mapped y -> (y - k) mod C",
    "uneven": "rotation groups of unequal sizes (--group-sizes, or --group-shares; "
              "default shares proportional to 1, 2, ..., G)",
    "dirichlet": "Dirichlet(--alpha, default 0.5) label skew only, no transform: every client in group 0",
    "class-sets": "group g holds only the classes of its set (--class-sets, default the OCFL sets "
                  "0-3/4-6/7-9)",
    "ocfl": "one of the OCFL paper's four named class-set splits (--ocfl-split)",
    "pathological": "each client holds --classes-per-client random classes (or --class-sets); "
                    "group = its class set",
}

#: ``--source`` kinds (``digits`` alone, the others as ``KIND:PATH``).
SOURCE_KINDS: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "idx", "npz")

_SOURCE_ALIASES = {"mnist": "mnist", "fashion-mnist": "fashion-mnist", "fashion_mnist": "fashion-mnist",
                   "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist", "idx": "idx", "npz": "npz"}
_SOURCE_FORMS = "digits, mnist:DIR, fashion-mnist:DIR, idx:DIR, or an .npz file (PATH.npz or npz:PATH)"
_SPLITS = ("train", "test", "all")
_VERIFY = {"yes": True, "no": False, "strict": "strict"}
_DEFAULT_GROUPS = 4
_DEFAULT_DIRICHLET_ALPHA = 0.5
_DEFAULT_OCFL_SPLIT = "nonoverlap_balanced"

#: Options that only some partitions use: dest -> partitions (a value given to another one is refused).
_APPLIES_TO: dict[str, tuple[str, ...]] = {
    "groups": ("rotation", "label-flip", "uneven"),
    "group_sizes": ("rotation", "label-flip", "uneven", "pathological"),
    "group_shares": ("uneven", "class-sets"),
    "alpha": ("rotation", "label-flip", "uneven", "dirichlet", "class-sets"),
    "num_classes": ("label-flip", "class-sets", "pathological"),
    "class_sets": ("class-sets", "pathological"),
    "overlapping": ("class-sets",),
    "ocfl_split": ("ocfl",),
    "classes_per_client": ("pathological",),
    "samples_per_client": ("class-sets", "ocfl"),
}


class _Error(Exception):
    """A user error: reported as one ``fedsketch-data: error:`` line, exit code 2."""


@dataclass(frozen=True)
class Source:
    """A loaded data set: ``x`` float32 images in [0, 1], ``y`` int64 labels, and where they came from."""

    x: np.ndarray
    y: np.ndarray
    name: str


# --------------------------------------------------------------------------- loading


def _parse_source(spec: str) -> tuple[str, str | None]:
    """``--source`` as (kind, path); kind is one of :data:`SOURCE_KINDS`."""
    text = spec.strip()
    if text.lower() == "digits":
        return "digits", None
    head, sep, tail = text.partition(":")
    kind = _SOURCE_ALIASES.get(head.strip().lower()) if sep else None
    if kind is not None:
        if not tail:
            raise _Error(f"--source {spec!r} names no path; expected {_SOURCE_FORMS}")
        return kind, tail
    if text.lower().endswith(".npz"):
        return "npz", text
    raise _Error(f"--source must be {_SOURCE_FORMS}; got {spec!r}")


def _images(arr: np.ndarray, where: str) -> np.ndarray:
    """Images as float32: integers scaled by 1/255, floats kept (a warning when outside [0, 1])."""
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer)
                                   or np.issubdtype(arr.dtype, np.floating)):
        raise _Error(f"{where}: x must hold numbers, got dtype {arr.dtype}")
    if arr.ndim < 2:
        raise _Error(f"{where}: x must be (N, ...) samples, got shape {arr.shape}")
    if np.issubdtype(arr.dtype, np.integer):
        return (arr.astype(np.float32) / np.float32(255.0)).astype(np.float32)
    x = arr.astype(np.float32)
    if x.size and (not np.all(np.isfinite(x)) or x.min() < 0.0 or x.max() > 1.0):
        logger.warning("%s: x is not within [0, 1] (the shipped models expect it there)", where)
    return x


def _labels(arr: np.ndarray, n: int, where: str) -> np.ndarray:
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise _Error(f"{where}: y must be a 1-D array of integer labels, got {arr.dtype} {arr.shape}")
    if len(arr) != n:
        raise _Error(f"{where}: {n} samples in x but {len(arr)} labels in y")
    if len(arr) and arr.min() < 0:
        raise _Error(f"{where}: labels must be >= 0, found {int(arr.min())}")
    return arr.astype(np.int64)


def _load_npz(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise _Error(f"--source {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as f:
            names = list(f.files)
            missing = [k for k in ("x", "y") if k not in names]
            if missing:
                raise _Error(f"{path} has no {' or '.join(repr(k) for k in missing)} array: an .npz "
                             f"source needs x and y (optionally x_test and y_test); it has {names}")
            has_test = "x_test" in names and "y_test" in names
            if split == "test" and not has_test:
                raise _Error(f"--split test: {path} has no x_test and y_test arrays")
            parts = []
            if split in ("train", "all"):
                parts.append((f["x"], f["y"], f"{path} (x, y)"))
            if split in ("test", "all") and has_test:
                parts.append((f["x_test"], f["y_test"], f"{path} (x_test, y_test)"))
    except (OSError, ValueError) as e:  # not an .npz, or object arrays (which need pickle)
        raise _Error(f"cannot read {path} as an .npz of plain arrays: {e}") from None
    xs, ys = [], []
    for x, y, where in parts:
        xs.append(_images(x, where))
        ys.append(_labels(y, len(x), where))
    if len({x.shape[1:] for x in xs}) > 1:
        raise _Error(f"{path}: x and x_test have different sample shapes {[x.shape[1:] for x in xs]}")
    return np.concatenate(xs), np.concatenate(ys)


def _load_idx(kind: str, path: Path, split: str, verify: bool | str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_dir():
        raise _Error(f"--source {kind}:{path}: no such folder")
    xs, ys = [], []
    for part in (("train", "test") if split == "all" else (split,)):
        if kind == "mnist":
            x, y = load_mnist(path, part, verify=verify)
        elif kind == "fashion-mnist":
            x, y = load_fashion_mnist(path, part, verify=verify)
        else:
            images, labels = load_idx_dataset(path, part, verify=verify)
            x = images.astype(np.float32) / np.float32(255.0)
            y = labels.astype(np.int64)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def load_source(spec: str = "digits", *, split: str = "train", verify: bool | str = True,
                max_samples: int | None = None, seed: int = 0) -> Source:
    """Load ``--source`` as float32 images in [0, 1] and int64 labels.

    Parameters
    ----------
    spec : str
        ``digits`` (scikit-learn's 1,797 8x8 digits), ``mnist:DIR``,
        ``fashion-mnist:DIR`` (the IDX files, in ``DIR`` or ``DIR/mnist`` /
        ``DIR/fashion-mnist``), ``idx:DIR`` (any MNIST-style IDX folder) or an
        ``.npz`` (``PATH.npz`` or ``npz:PATH``) with ``x``, ``y`` and
        optionally ``x_test``, ``y_test`` (integer images are scaled by 1/255).
    split : {"train", "test", "all"}
        Which part of the data set to partition (``all``: both, concatenated).
        digits has only one part (``train`` and ``all`` are the whole set).
    verify : bool or "strict"
        Checksum check of IDX files (see :func:`~server_kit.data.idx.load_idx_dataset`).
    max_samples : int, optional
        Keep a random subset of this many samples (seeded by ``seed``).
    seed : int

    Returns
    -------
    Source

    Raises
    ------
    ValueError
        On a source that is missing, malformed or not one of the forms above.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {list(_SPLITS)}, got {split!r}")
    try:
        return _load_source(spec, split, verify, max_samples, seed)
    except _Error as e:
        raise ValueError(str(e)) from None


def _load_source(spec: str, split: str, verify: bool | str, max_samples: int | None, seed: int) -> Source:
    kind, path = _parse_source(spec)
    if kind == "digits":
        if split == "test":
            raise _Error("--split test: digits has no separate test split; use --split train")
        x, y = load_digits_images()
        name = "digits"
    elif kind == "npz":
        x, y = _load_npz(Path(path), split)
        name = str(path)
    else:
        x, y = _load_idx(kind, Path(path), split, verify)
        name = f"{kind}:{path}"
    if len(y) == 0:
        raise _Error(f"--source {spec}: no samples")
    if max_samples is not None and max_samples < len(y):
        keep = np.sort(np.random.default_rng(seed).choice(len(y), max_samples, replace=False))
        x, y = x[keep], y[keep]
    logger.info("loaded %s (%s): %d samples %s", name, split, len(y), x.shape[1:])
    return Source(np.ascontiguousarray(x, dtype=np.float32), y, name)


# --------------------------------------------------------------------------- partitioning


def _uneven_sizes(n_clients: int, groups: int, args: argparse.Namespace) -> list[int]:
    if args.group_sizes is not None:
        return list(args.group_sizes)
    shares = args.group_shares
    if shares is None:
        w = np.arange(1, groups + 1, dtype=np.float64)
        shares = list(w / w.sum())
    return group_sizes_from_shares(n_clients, shares)


def _n_groups(args: argparse.Namespace) -> int:
    """How many groups the chosen partition makes (the upper bound for pathological)."""
    p = args.partition
    if p in ("rotation", "label-flip", "uneven"):
        if args.group_sizes is not None:
            return len(args.group_sizes)
        if p == "uneven" and args.group_shares is not None:
            return len(args.group_shares)
        return _DEFAULT_GROUPS if args.groups is None else args.groups
    if p == "dirichlet":
        return 1
    if p == "class-sets":
        if args.class_sets is not None:
            return len(args.class_sets)
        return len(OCFL_CLASS_SETS)
    if p == "ocfl":
        return len(OCFL_CLASS_SETS)
    return len(args.class_sets) if args.class_sets is not None else 1  # pathological


def partition(source: Source, args: argparse.Namespace) -> list[ClientData]:
    """Split ``source`` with the partition and options of parsed ``fedsketch-data split`` arguments."""
    p, n = args.partition, args.clients
    common = {"min_size": args.min_size, "test_fraction": args.test_fraction, "seed": args.seed}
    if p in ("rotation", "label-flip", "uneven") and args.groups is not None and args.group_sizes is not None \
            and args.groups != len(args.group_sizes):
        raise _Error(f"--groups {args.groups} disagrees with --group-sizes "
                     f"({len(args.group_sizes)} groups)")
    if p == "uneven" and args.group_sizes is not None and args.group_shares is not None:
        raise _Error("--group-sizes and --group-shares both set the group sizes; give one")
    groups = _n_groups(args)
    if n < groups:
        raise _Error(f"--clients {n} is fewer than the {groups} groups of --partition {p}: "
                     "every group needs at least one client")
    if p == "rotation":
        return rotation_groups(source.x, source.y, n, groups=None if args.group_sizes else groups,
                               group_sizes=args.group_sizes, alpha=args.alpha, **common)
    if p == "uneven":
        sizes = _uneven_sizes(n, groups, args)
        return rotation_groups(source.x, source.y, n, group_sizes=sizes, alpha=args.alpha, **common)
    if p == "label-flip":
        num_classes = _num_classes(source, args, at_least=2)
        return label_flip_groups(source.x, source.y, n, groups=None if args.group_sizes else groups,
                                 group_sizes=args.group_sizes, num_classes=num_classes,
                                 alpha=args.alpha, **common)
    if p == "dirichlet":
        alpha = _DEFAULT_DIRICHLET_ALPHA if args.alpha is None else args.alpha
        return rotation_groups(source.x, source.y, n, groups=1, alpha=alpha, **common)
    if p == "class-sets":
        return class_set_groups(source.x, source.y, n, class_sets=args.class_sets,
                                overlapping=bool(args.overlapping), group_shares=args.group_shares,
                                alpha=args.alpha, samples_per_client=args.samples_per_client,
                                num_classes=args.num_classes, **common)
    if p == "ocfl":
        return class_set_groups(source.x, source.y, n, samples_per_client=args.samples_per_client,
                                **OCFL_SPLITS[args.ocfl_split or _DEFAULT_OCFL_SPLIT], **common)
    return pathological_partition(source.x, source.y, n, classes_per_client=args.classes_per_client,
                                  class_sets=args.class_sets, group_sizes=args.group_sizes,
                                  num_classes=args.num_classes, **common)


def _num_classes(source: Source, args: argparse.Namespace, at_least: int = 1) -> int:
    return args.num_classes if args.num_classes is not None else max(int(source.y.max()) + 1, at_least)


# --------------------------------------------------------------------------- writing


def write_clients(clients: Sequence[ClientData], out: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``OUT/<cid>.npz`` per client and ``OUT/truth.json`` (``{cid: group}``); returns the truth path.

    An ``out`` that already holds ``.npz`` files or a ``truth.json`` is refused
    unless ``overwrite``; then the client files of the old ``truth.json`` that
    the new split does not have are removed, so no stale client is left.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    truth_path = out / "truth.json"
    if out.is_dir():
        old = sorted(p.name for p in out.glob("*.npz")) + (["truth.json"] if truth_path.exists() else [])
        if old and not overwrite:
            shown = ", ".join(old[:3]) + (", ..." if len(old) > 3 else "")
            raise ValueError(f"--out {out} already holds {shown}; pass --overwrite or another --out")
        if old and truth_path.exists():
            try:
                stale = set(json.loads(truth_path.read_text())) - {c.cid for c in clients}
            except (OSError, ValueError, TypeError):
                stale = set()
            for cid in sorted(stale):
                f = out / f"{cid}.npz"
                if f.is_file():
                    f.unlink()
                    logger.info("removed stale %s", f)
    out.mkdir(parents=True, exist_ok=True)
    for c in clients:
        save_client(out / f"{c.cid}.npz", c)
    truth = {c.cid: int(c.group) for c in clients}
    truth_path.write_text(json.dumps(truth, indent=1) + "\n")
    return truth_path


def _span(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _group_note(p: str, g: int, members: Sequence[ClientData], num_classes: int) -> str:
    if p in ("rotation", "uneven"):
        return f"rotated {90 * g} degrees"
    if p == "label-flip":
        return "labels unchanged" if g == 0 else f"labels y -> (y - {g}) mod {num_classes}"
    if p == "dirichlet":
        return "label skew only"
    classes = sorted({int(v) for c in members for a in (c.y_train, c.y_test) for v in np.unique(a)})
    return f"classes {classes}"


def _summary(source: Source, clients: Sequence[ClientData], args: argparse.Namespace, truth: Path) -> str:
    out = Path(args.out)
    n_train = [len(c.y_train) for c in clients]
    n_test = [len(c.y_test) for c in clients]
    n_total = [a + b for a, b in zip(n_train, n_test)]
    shape = source.x.shape[1:]
    shape_text = "x".join(str(d) for d in shape)
    by_group: dict[int, list[ClientData]] = {}
    for c in clients:
        by_group.setdefault(int(c.group), []).append(c)
    num_classes = _num_classes(source, args, at_least=2 if args.partition == "label-flip" else 1)
    lines = [
        f"{PROG}: {len(clients)} clients in {len(by_group)} groups (--partition {args.partition}) from "
        f"{source.name}: {len(source.y)} samples ({args.split}), {shape_text} images, {num_classes} classes",
        f"  samples per client: {_span(n_total)} (train {_span(n_train)}, test {_span(n_test)})",
    ]
    for g, members in sorted(by_group.items()):
        ids = " ".join(c.cid for c in members)
        lines.append(f"  group {g} ({_group_note(args.partition, g, members, num_classes)}): "
                     f"{len(members)} clients: {ids}")
    lines.append(f"  wrote {out / clients[0].cid}.npz .. {clients[-1].cid}.npz and {truth}")
    lines.append("")
    lines.extend(_next_commands(len(clients), shape, num_classes, out))
    return "\n".join(lines)


def _next_commands(n_clients: int, shape: tuple[int, ...], num_classes: int, out: Path) -> list[str]:
    from edge_sdk.artifacts import models_for_shape

    broker = "mqtt://127.0.0.1:1883"
    encoder, architecture = models_for_shape(tuple(shape))
    server = ["fedsketch-server", "--broker", broker, "--federation", "lab", "--strategy", "fedsketch",
              "--min-clients", str(n_clients), "--num-classes", str(num_classes),
              "--truth", str(out / "truth.json")]
    note = []
    if encoder is None or architecture is None:
        note = [f"(no shipped encoder or classifier takes {'x'.join(map(str, shape))} inputs: give the server "
                "--encoder and --architecture, for models of your own)"]
    else:
        note = [f"(the server picks {encoder} and {architecture} for these {'x'.join(map(str, shape))} samples "
                "and tells the devices)"]
    client = ["fedsketch-client", "--broker", broker, "--federation", "lab",
              "--client-id", '"$(basename "$f" .npz)"', "--data", '"$f"']
    glob = shlex.quote(str(out)) + "/*.npz"
    return [
        "next: with an MQTT broker on 127.0.0.1:1883 (e.g. `mosquitto -p 1883 &`), run the server, "
        "then one client per file:",
        "  " + " ".join(shlex.quote(a) for a in server) + " --report-dir reports/lab &",
        f"  for f in {glob}; do {' '.join(client)} & done; wait",
        *note,
    ]


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
                     help=f"the data set: {_SOURCE_FORMS}. digits is scikit-learn's 1,797 8x8 digits "
                          "(no download); MNIST-style folders hold train-images-idx3-ubyte[.gz] etc.")
    src.add_argument("--split", choices=_SPLITS, default="train",
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
                      help=f"groups of rotation (1-4), label-flip and uneven (default: {_DEFAULT_GROUPS})")
    part.add_argument("--group-sizes", type=_int_list, default=None, metavar="S0,S1,...",
                      help="clients per group, in contiguous blocks (must sum to --clients)")
    part.add_argument("--group-shares", type=_float_list, default=None, metavar="W0,W1,...",
                      help="share of the clients per group, summing to 1 (uneven, class-sets)")
    part.add_argument("--alpha", type=_positive_float, default=None, metavar="A",
                      help="Dirichlet(A) label skew (small A: few classes per client); unset: equal "
                           f"random shards (dirichlet: {_DEFAULT_DIRICHLET_ALPHA})")
    part.add_argument("--num-classes", type=_positive_int, default=None, metavar="C",
                      help="number of classes (default: largest label + 1)")
    part.add_argument("--class-sets", type=_class_sets, default=None, metavar="0,1,2,3/4,5,6/...",
                      help="the classes of each group (class-sets, pathological)")
    part.add_argument("--overlapping", action="store_const", const=True, default=None,
                      help="class-sets: the groups share classes (default sets: the OCFL overlapping ones)")
    part.add_argument("--ocfl-split", choices=list(OCFL_SPLITS), default=None,
                      help=f"ocfl: which of the paper's splits (default: {_DEFAULT_OCFL_SPLIT})")
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


def _check_applicable(args: argparse.Namespace) -> None:
    for dest, partitions in _APPLIES_TO.items():
        if getattr(args, dest) is not None and args.partition not in partitions:
            flag = "--" + dest.replace("_", "-")
            raise _Error(f"{flag} does not apply to --partition {args.partition}; "
                         f"it applies to {', '.join(partitions)}")


def run_split(args: argparse.Namespace) -> int:
    """The ``split`` command on parsed arguments; raises ``_Error`` or ``ValueError`` on bad input."""
    _check_applicable(args)
    if args.partition == "pathological" and args.classes_per_client is None:
        args.classes_per_client = 2
    source = _load_source(args.source, args.split, _VERIFY[args.verify], args.max_samples, args.seed)
    clients = partition(source, args)
    truth = write_clients(clients, args.out, overwrite=args.overwrite)
    print(_summary(source, clients, args, truth))
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
    except (_Error, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
