"""Pure-numpy reader of IDX files (the MNIST / Fashion-MNIST format).

An IDX file starts with a 4-byte magic number ``00 00 <type> <ndim>``,
followed by ``ndim`` big-endian uint32 dimension sizes and the array data in
C order, big-endian. Files may be gzip-compressed (detected from their first
two bytes, not their name).
"""

from __future__ import annotations

import gzip
import logging
import os
from pathlib import Path

import numpy as np

__all__ = ["IDX_DTYPES", "IDX_FILES", "load_idx_dataset", "read_idx", "parse_idx"]

logger = logging.getLogger(__name__)

#: IDX type code -> big-endian numpy dtype.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

#: Split -> (images file, labels file), as MNIST and Fashion-MNIST name them.
IDX_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    """Raw bytes of ``path``, gunzipped when the file is gzip-compressed."""
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: corrupt gzip stream ({e})") from e
    return raw


def parse_idx(buf: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode an uncompressed IDX byte string.

    Parameters
    ----------
    buf : bytes
        The whole (uncompressed) file.
    source : str
        Name used in error messages.

    Returns
    -------
    numpy.ndarray
        The array in native byte order, with the shape the header declares.

    Raises
    ------
    ValueError
        On a bad magic number, an unknown type code, a truncated header, or
        a data section whose size differs from the one the header declares.
    """
    if len(buf) < 4:
        raise ValueError(f"{source}: truncated IDX header ({len(buf)} bytes, need at least 4)")
    if buf[0] != 0 or buf[1] != 0:
        raise ValueError(
            f"{source}: bad IDX magic number 0x{buf[:4].hex()} (must start with two zero bytes)"
        )
    type_code, ndim = buf[2], buf[3]
    if type_code not in IDX_DTYPES:
        raise ValueError(
            f"{source}: bad IDX magic number 0x{buf[:4].hex()} (unknown type code 0x{type_code:02x})"
        )
    if ndim == 0:
        raise ValueError(f"{source}: bad IDX magic number 0x{buf[:4].hex()} (zero dimensions)")
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise ValueError(
            f"{source}: truncated IDX header ({len(buf)} bytes, need {header} for {ndim} dimensions)"
        )
    shape = tuple(int(d) for d in np.frombuffer(buf, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(buf) - header
    if actual < expected:
        raise ValueError(
            f"{source}: truncated IDX data ({actual} bytes, the header {shape} declares {expected})"
        )
    if actual > expected:
        raise ValueError(
            f"{source}: IDX data has {actual - expected} trailing bytes beyond the declared shape {shape}"
        )
    arr = np.frombuffer(buf, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file, gzip-compressed or raw.

    Parameters
    ----------
    path : str or os.PathLike
        The file.

    Returns
    -------
    numpy.ndarray
        The array in native byte order.

    Raises
    ------
    ValueError
        If the file is not a well-formed IDX file (see :func:`parse_idx`).
    """
    p = Path(path)
    arr = parse_idx(_read_bytes(p), source=str(p))
    logger.debug("read %s: shape %s dtype %s", p, arr.shape, arr.dtype)
    return arr


def _find(directory: Path, stem: str) -> Path:
    """``stem`` or ``stem.gz`` in ``directory`` (the compressed one first)."""
    for name in (stem + ".gz", stem):
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"neither {stem}.gz nor {stem} found in {directory}")


def load_idx_dataset(
    directory: str | os.PathLike[str], split: str = "train"
) -> tuple[np.ndarray, np.ndarray]:
    """Load an MNIST-style split (images and labels) from a folder.

    Parameters
    ----------
    directory : str or os.PathLike
        Folder with ``train-images-idx3-ubyte[.gz]``,
        ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]`` and
        ``t10k-labels-idx1-ubyte[.gz]``.
    split : {"train", "test"}
        Which pair of files to read.

    Returns
    -------
    images : numpy.ndarray
        ``uint8`` array ``(N, H, W)`` (28x28 for MNIST and Fashion-MNIST).
    labels : numpy.ndarray
        ``uint8`` array ``(N,)``.

    Raises
    ------
    ValueError
        On an unknown split, malformed files, or images and labels that do
        not match (type, rank or count).
    FileNotFoundError
        If a file is missing.
    """
    if split not in IDX_FILES:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(IDX_FILES)}")
    d = Path(directory)
    img_stem, lbl_stem = IDX_FILES[split]
    img_path, lbl_path = _find(d, img_stem), _find(d, lbl_stem)
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(
            f"{img_path}: expected uint8 images (N, H, W), got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(
            f"{lbl_path}: expected uint8 labels (N,), got {labels.dtype} {labels.shape}"
        )
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{d}: {images.shape[0]} images but {labels.shape[0]} labels in the {split!r} split"
        )
    logger.info(
        "loaded %s split from %s: %d images %s", split, d, images.shape[0], images.shape[1:]
    )
    return images, labels
