"""The partition a parsed ``fedsketch-data split`` asks for: options checked, the partitioner called."""

from __future__ import annotations

import argparse

import numpy as np

from server_kit.data.partition import (
    OCFL_CLASS_SETS,
    OCFL_SPLITS,
    ClientData,
    class_set_groups,
    group_sizes_from_shares,
    label_flip_groups,
    pathological_partition,
    rotation_groups,
)
from server_kit.data.sources import Source, SplitError

__all__ = [
    "APPLIES_TO",
    "DEFAULT_DIRICHLET_ALPHA",
    "DEFAULT_GROUPS",
    "DEFAULT_OCFL_SPLIT",
    "PARTITIONS",
    "check_applicable",
    "class_count",
    "partition",
]

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

#: Groups of rotation, label-flip and uneven when neither --groups nor --group-sizes says.
DEFAULT_GROUPS = 4
#: --alpha of the dirichlet partition.
DEFAULT_DIRICHLET_ALPHA = 0.5
#: --ocfl-split by default.
DEFAULT_OCFL_SPLIT = "nonoverlap_balanced"

#: Options that only some partitions use: dest -> partitions (a value given to another one is refused).
APPLIES_TO: dict[str, tuple[str, ...]] = {
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


def check_applicable(args: argparse.Namespace) -> None:
    """Refuse an option given to a partition that does not use it."""
    for dest, partitions in APPLIES_TO.items():
        if getattr(args, dest) is not None and args.partition not in partitions:
            flag = "--" + dest.replace("_", "-")
            raise SplitError(f"{flag} does not apply to --partition {args.partition}; "
                             f"it applies to {', '.join(partitions)}")


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
        return DEFAULT_GROUPS if args.groups is None else args.groups
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
        raise SplitError(f"--groups {args.groups} disagrees with --group-sizes "
                     f"({len(args.group_sizes)} groups)")
    if p == "uneven" and args.group_sizes is not None and args.group_shares is not None:
        raise SplitError("--group-sizes and --group-shares both set the group sizes; give one")
    groups = _n_groups(args)
    if n < groups:
        raise SplitError(f"--clients {n} is fewer than the {groups} groups of --partition {p}: "
                     "every group needs at least one client")
    if p == "rotation":
        return rotation_groups(source.x, source.y, n, groups=None if args.group_sizes else groups,
                               group_sizes=args.group_sizes, alpha=args.alpha, **common)
    if p == "uneven":
        sizes = _uneven_sizes(n, groups, args)
        return rotation_groups(source.x, source.y, n, group_sizes=sizes, alpha=args.alpha, **common)
    if p == "label-flip":
        num_classes = class_count(source, args, at_least=2)
        return label_flip_groups(source.x, source.y, n, groups=None if args.group_sizes else groups,
                                 group_sizes=args.group_sizes, num_classes=num_classes,
                                 alpha=args.alpha, **common)
    if p == "dirichlet":
        alpha = DEFAULT_DIRICHLET_ALPHA if args.alpha is None else args.alpha
        return rotation_groups(source.x, source.y, n, groups=1, alpha=alpha, **common)
    if p == "class-sets":
        return class_set_groups(source.x, source.y, n, class_sets=args.class_sets,
                                overlapping=bool(args.overlapping), group_shares=args.group_shares,
                                alpha=args.alpha, samples_per_client=args.samples_per_client,
                                num_classes=args.num_classes, **common)
    if p == "ocfl":
        return class_set_groups(source.x, source.y, n, samples_per_client=args.samples_per_client,
                                **OCFL_SPLITS[args.ocfl_split or DEFAULT_OCFL_SPLIT], **common)
    return pathological_partition(source.x, source.y, n, classes_per_client=args.classes_per_client,
                                  class_sets=args.class_sets, group_sizes=args.group_sizes,
                                  num_classes=args.num_classes, **common)


def class_count(source: Source, args: argparse.Namespace, at_least: int = 1) -> int:
    """``--num-classes``, else the largest label + 1 (at least ``at_least``)."""
    return args.num_classes if args.num_classes is not None else max(int(source.y.max()) + 1, at_least)
