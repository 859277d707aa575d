"""The samples a benchmark sketches: the device's own ``--data`` file, or generated ones of an encoder's shape.

A data file is read without pickle and checked whole before anything is
timed; whatever is wrong with it is one :class:`~edge_sdk.bench.errors.BenchError`
line (exit 2): missing, unreadable, pickled, without ``x`` or ``y``, of a
dtype or shape no shipped encoder takes.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..models.artifacts import ArtifactSpec, load_manifest
from .errors import BenchError

__all__ = [
    "PIXEL_SCALE",
    "check_names",
    "encoder_shapes",
    "fitting_encoders",
    "for_encoder",
    "generated",
    "load_data",
    "shipped_encoders",
]

#: Integer images are divided by this (0..255 pixels -> [0, 1]), as ``fedsketch sketch`` does.
PIXEL_SCALE = 255.0


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _shape_str(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) or "()"


def shipped_encoders() -> dict[str, ArtifactSpec]:
    """The shipped artifacts of role ``encoder``, by name (sorted)."""
    return {n: s for n, s in sorted(load_manifest().items()) if s.role == "encoder"}


def encoder_shapes(spec: ArtifactSpec) -> str:
    """The per-sample shapes an encoder takes: ``"64 or 8x8"``, ``"3x32x32"``."""
    shapes = [spec.input_shape]
    if spec.image_shape and int(np.prod(spec.image_shape)) == int(np.prod(spec.input_shape)):
        shapes.append(spec.image_shape)
    return " or ".join(_shape_str(s) for s in shapes)


def _all_shapes(encoders: dict[str, ArtifactSpec]) -> str:
    return ", ".join(f"{n} ({encoder_shapes(s)})" for n, s in encoders.items())


def _array(f: np.lib.npyio.NpzFile, key: str, path: str) -> np.ndarray:
    try:
        return f[key]
    except ValueError as e:  # object arrays: "Object arrays cannot be loaded when allow_pickle=False"
        raise BenchError(f"--data {path}: array {key!r} holds pickled Python objects, which bench does not "
                         f"load; save numeric arrays ({_one_line(e)})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise BenchError(f"--data {path}: cannot read array {key!r} ({_one_line(e)})") from None


def _open(path: str) -> np.lib.npyio.NpzFile:
    if not Path(path).is_file():
        raise BenchError(f"--data {path}: no such file")
    try:
        with open(path, "rb") as raw:
            head = raw.read(6)
    except OSError as e:
        raise BenchError(f"--data {path}: cannot read it ({e.strerror or e})") from None
    if head[:1] == b"\x80":
        raise BenchError(f"--data {path}: a pickle file, which bench does not load; save the arrays with "
                         "numpy.savez(FILE, x=..., y=...)")
    if not (head.startswith(b"PK") or head.startswith(b"\x93NUMPY")):
        raise BenchError(f"--data {path}: not an .npz file (no zip header); save the arrays with "
                         "numpy.savez(FILE, x=..., y=...)")
    try:
        f = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise BenchError(f"--data {path}: cannot read it as an .npz file ({_one_line(e)})") from None
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise BenchError(f"--data {path}: a single .npy array; bench needs an .npz file with arrays x and y")
    return f


def load_data(path: str, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The device's ``x`` (float32 in [0, 1]) and ``y`` (int64 in [0, classes)) from an ``.npz`` file.

    Integer images are divided by :data:`PIXEL_SCALE`. Raises
    :class:`BenchError` (one line, exit 2) for anything bench cannot use.
    """
    with _open(path) as f:
        missing = [k for k in ("x", "y") if k not in f.files]
        if missing:
            raise BenchError(f"--data {path}: no array {' and no array '.join(missing)} (it holds "
                             f"{sorted(f.files)}); bench needs x (the samples) and y (their integer labels)")
        x, y = _array(f, "x", path), _array(f, "y", path)
    if x.dtype == np.bool_ or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise BenchError(f"--data {path}: x has dtype {x.dtype}; bench takes float images in [0, 1] "
                         "or integer pixels in [0, 255]")
    if y.dtype == np.bool_ or not np.issubdtype(y.dtype, np.integer):
        raise BenchError(f"--data {path}: y has dtype {y.dtype}; labels must be integers")
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(y) == 0:
        raise BenchError(f"--data {path}: x has shape {x.shape} and y {y.shape}; bench needs x of shape "
                         "(n, ...) and y of shape (n,), n > 0")
    xf = x.astype(np.float32) / np.float32(PIXEL_SCALE) if np.issubdtype(x.dtype, np.integer) \
        else x.astype(np.float32, copy=False)
    lo, hi = float(xf.min()), float(xf.max())
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0.0 or hi > 1.0:
        raise BenchError(f"--data {path}: x values span [{lo:g}, {hi:g}] (integers divided by "
                         f"{PIXEL_SCALE:g}); the shipped encoders take [0, 1]")
    ylo, yhi = int(y.min()), int(y.max())
    if ylo < 0 or yhi >= classes:
        raise BenchError(f"--data {path}: labels span [{ylo}, {yhi}]; with --classes {classes} they must lie "
                         f"in [0, {classes})")
    return xf, y.astype(np.int64, copy=False)


def fitting_encoders(x: np.ndarray, path: str, wanted: Sequence[str] = ()) -> list[str]:
    """The shipped encoders ``x``'s samples fit (as many values as the input), among ``wanted`` when given.

    Raises :class:`BenchError` when a wanted encoder does not fit, or when
    none fits, naming the shapes the shipped encoders take.
    """
    encoders = shipped_encoders()
    size = int(np.prod(x.shape[1:]))
    fits = [n for n, s in encoders.items() if int(np.prod(s.input_shape)) == size]
    for name in wanted:
        if name not in fits:
            raise BenchError(f"--data {path}: samples of shape {_shape_str(x.shape[1:])} do not fit encoder "
                             f"{name}, which takes {encoder_shapes(encoders[name])}")
    if wanted:
        return list(wanted)
    if not fits:
        raise BenchError(f"--data {path}: no shipped encoder takes samples of shape {_shape_str(x.shape[1:])}; "
                         f"the shipped encoders take: {_all_shapes(encoders)}")
    return fits


def check_names(names: Sequence[str]) -> list[str]:
    """``--encoder`` names, checked against the shipped encoders (BenchError naming them otherwise)."""
    encoders = shipped_encoders()
    unknown = [n for n in names if n not in encoders]
    if unknown:
        raise BenchError(f"unknown encoder {unknown[0]!r}; the shipped encoders: {_all_shapes(encoders)}")
    return list(dict.fromkeys(names))


def for_encoder(x: np.ndarray, spec: ArtifactSpec) -> np.ndarray:
    """``x`` reshaped to ``(n, *input_shape)`` of the encoder (same number of values per sample)."""
    return np.ascontiguousarray(x.reshape((len(x),) + tuple(spec.input_shape)))


def generated(shape: Sequence[int], n: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` seeded uniform [0, 1) float32 samples of ``shape`` and labels ``0, 1, ..., classes - 1, 0, ...``."""
    rng = np.random.default_rng(seed)
    x = rng.random((int(n), *map(int, shape)), dtype=np.float32)
    return x, np.arange(int(n), dtype=np.int64) % int(classes)
