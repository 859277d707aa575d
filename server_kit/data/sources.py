"""``--source`` of ``fedsketch-data``: a data set read as float32 images in [0, 1] and int64 labels.

scikit-learn's digits, MNIST or Fashion-MNIST from their IDX files, any
MNIST-style IDX folder, or an ``.npz`` with ``x``, ``y`` (optionally
``x_test``, ``y_test``): :func:`load_source`. Also the command's name and its
user error, shared by the modules of ``fedsketch-data split``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sdk.validation import check_choice
from server_kit.data.clients import load_digits_images
from server_kit.data.idx import load_fashion_mnist, load_idx_dataset, load_mnist

__all__ = ["PROG", "SOURCE_FORMS", "SOURCE_KINDS", "SPLITS", "Source", "SplitError", "load_source", "read_source"]

#: The command's logger: its lines keep the name ``fedsketch-data`` has always printed.
logger = logging.getLogger("server_kit.data.split")

#: The command's name, at the start of its error lines and its summary.
PROG = "fedsketch-data"

#: ``--source`` kinds (``digits`` alone, the others as ``KIND:PATH``).
SOURCE_KINDS: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "idx", "npz")

_SOURCE_ALIASES = {"mnist": "mnist", "fashion-mnist": "fashion-mnist", "fashion_mnist": "fashion-mnist",
                   "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist", "idx": "idx", "npz": "npz"}
#: The forms ``--source`` takes, as the error messages and ``--help`` spell them.
SOURCE_FORMS = "digits, mnist:DIR, fashion-mnist:DIR, idx:DIR, or an .npz file (PATH.npz or npz:PATH)"
#: ``--split`` choices: which part of the data set to partition.
SPLITS = ("train", "test", "all")


class SplitError(Exception):
    """A user error: reported as one ``fedsketch-data: error:`` line, exit code 2."""


@dataclass(frozen=True)
class Source:
    """A loaded data set: ``x`` float32 images in [0, 1], ``y`` int64 labels, and where they came from."""

    x: np.ndarray
    y: np.ndarray
    name: str


def _parse_source(spec: str) -> tuple[str, str | None]:
    """``--source`` as (kind, path); kind is one of :data:`SOURCE_KINDS`."""
    text = spec.strip()
    if text.lower() == "digits":
        return "digits", None
    head, sep, tail = text.partition(":")
    kind = _SOURCE_ALIASES.get(head.strip().lower()) if sep else None
    if kind is not None:
        if not tail:
            raise SplitError(f"--source {spec!r} names no path; expected {SOURCE_FORMS}")
        return kind, tail
    if text.lower().endswith(".npz"):
        return "npz", text
    raise SplitError(f"--source must be {SOURCE_FORMS}; got {spec!r}")


def _images(arr: np.ndarray, where: str) -> np.ndarray:
    """Images as float32: integers scaled by 1/255, floats kept (a warning when outside [0, 1])."""
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer)
                                   or np.issubdtype(arr.dtype, np.floating)):
        raise SplitError(f"{where}: x must hold numbers, got dtype {arr.dtype}")
    if arr.ndim < 2:
        raise SplitError(f"{where}: x must be (N, ...) samples, got shape {arr.shape}")
    if np.issubdtype(arr.dtype, np.integer):
        return (arr.astype(np.float32) / np.float32(255.0)).astype(np.float32)
    x = arr.astype(np.float32)
    if x.size and (not np.all(np.isfinite(x)) or x.min() < 0.0 or x.max() > 1.0):
        logger.warning("%s: x is not within [0, 1] (the shipped models expect it there)", where)
    return x


def _labels(arr: np.ndarray, n: int, where: str) -> np.ndarray:
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise SplitError(f"{where}: y must be a 1-D array of integer labels, got {arr.dtype} {arr.shape}")
    if len(arr) != n:
        raise SplitError(f"{where}: {n} samples in x but {len(arr)} labels in y")
    if len(arr) and arr.min() < 0:
        raise SplitError(f"{where}: labels must be >= 0, found {int(arr.min())}")
    return arr.astype(np.int64)


def _load_npz(path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise SplitError(f"--source {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as f:
            names = list(f.files)
            missing = [k for k in ("x", "y") if k not in names]
            if missing:
                raise SplitError(f"{path} has no {' or '.join(repr(k) for k in missing)} array: an .npz "
                             f"source needs x and y (optionally x_test and y_test); it has {names}")
            has_test = "x_test" in names and "y_test" in names
            if split == "test" and not has_test:
                raise SplitError(f"--split test: {path} has no x_test and y_test arrays")
            parts = []
            if split in ("train", "all"):
                parts.append((f["x"], f["y"], f"{path} (x, y)"))
            if split in ("test", "all") and has_test:
                parts.append((f["x_test"], f["y_test"], f"{path} (x_test, y_test)"))
    except (OSError, ValueError) as e:  # not an .npz, or object arrays (which need pickle)
        raise SplitError(f"cannot read {path} as an .npz of plain arrays: {e}") from None
    xs, ys = [], []
    for x, y, where in parts:
        xs.append(_images(x, where))
        ys.append(_labels(y, len(x), where))
    if len({x.shape[1:] for x in xs}) > 1:
        raise SplitError(f"{path}: x and x_test have different sample shapes {[x.shape[1:] for x in xs]}")
    return np.concatenate(xs), np.concatenate(ys)


def _load_idx(kind: str, path: Path, split: str, verify: bool | str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_dir():
        raise SplitError(f"--source {kind}:{path}: no such folder")
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
    check_choice(split, "split", SPLITS)
    try:
        return read_source(spec, split, verify, max_samples, seed)
    except SplitError as e:
        raise ValueError(str(e)) from None


def read_source(spec: str, split: str, verify: bool | str, max_samples: int | None, seed: int) -> Source:
    """:func:`load_source` for the command line: bad input raises :class:`SplitError`."""
    kind, path = _parse_source(spec)
    if kind == "digits":
        if split == "test":
            raise SplitError("--split test: digits has no separate test split; use --split train")
        x, y = load_digits_images()
        name = "digits"
    elif kind == "npz":
        x, y = _load_npz(Path(path), split)
        name = str(path)
    else:
        x, y = _load_idx(kind, Path(path), split, verify)
        name = f"{kind}:{path}"
    if len(y) == 0:
        raise SplitError(f"--source {spec}: no samples")
    if max_samples is not None and max_samples < len(y):
        keep = np.sort(np.random.default_rng(seed).choice(len(y), max_samples, replace=False))
        x, y = x[keep], y[keep]
    logger.info("loaded %s (%s): %d samples %s", name, split, len(y), x.shape[1:])
    return Source(np.ascontiguousarray(x, dtype=np.float32), y, name)
