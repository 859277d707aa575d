"""Pure-numpy reader of IDX files (the MNIST / Fashion-MNIST format).

An IDX file starts with a 4-byte magic number ``00 00 <type> <ndim>``,
followed by ``ndim`` big-endian uint32 dimension sizes and the array data in
C order, big-endian. Files may be gzip-compressed (detected from their first
two bytes, not their name).

:func:`load_idx_dataset` also checks the files against the sha256 of the
published MNIST and Fashion-MNIST ``.gz`` originals (:data:`KNOWN_SHA256`), and
:func:`load_mnist` / :func:`load_fashion_mnist` return model-ready arrays.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
from pathlib import Path

import numpy as np

__all__ = [
    "DATASETS",
    "IDX_DTYPES",
    "IDX_FILES",
    "KNOWN_SHA256",
    "load_fashion_mnist",
    "load_idx_dataset",
    "load_mnist",
    "parse_idx",
    "read_idx",
]

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

#: Canonical dataset names, as :data:`KNOWN_SHA256` and ``dataset=`` use them.
DATASETS: tuple[str, ...] = ("mnist", "fashion-mnist")

#: sha256 of the published ``.gz`` originals, keyed by (dataset, file name).
#: The same values as ``shared/data/SHA256SUMS``; the files' md5s are the ones
#: the publishers give.
KNOWN_SHA256: dict[tuple[str, str], str] = {
    ("mnist", "train-images-idx3-ubyte.gz"):
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    ("mnist", "train-labels-idx1-ubyte.gz"):
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    ("mnist", "t10k-images-idx3-ubyte.gz"):
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    ("mnist", "t10k-labels-idx1-ubyte.gz"):
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    ("fashion-mnist", "train-images-idx3-ubyte.gz"):
        "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
    ("fashion-mnist", "train-labels-idx1-ubyte.gz"):
        "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
    ("fashion-mnist", "t10k-images-idx3-ubyte.gz"):
        "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
    ("fashion-mnist", "t10k-labels-idx1-ubyte.gz"):
        "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
}

#: sha256 -> (dataset, file name), to recognise a file by its content.
_BY_SHA256: dict[str, tuple[str, str]] = {h: key for key, h in KNOWN_SHA256.items()}

_DATASET_ALIASES: dict[str, str] = {
    "mnist": "mnist",
    "fashion-mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "fmnist": "fashion-mnist",
}

_PRETTY = {"mnist": "MNIST", "fashion-mnist": "Fashion-MNIST"}

_GZIP_MAGIC = b"\x1f\x8b"


def _decode(raw: bytes, path: Path) -> bytes:
    """``raw`` gunzipped when it is gzip-compressed, else unchanged."""
    if raw[:2] == _GZIP_MAGIC:
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: corrupt gzip stream ({e})") from e
    return raw


def _read_bytes(path: Path) -> bytes:
    """Raw bytes of ``path``, gunzipped when the file is gzip-compressed."""
    return _decode(path.read_bytes(), path)


def _canonical_dataset(dataset: str | None) -> str | None:
    """``dataset`` as one of :data:`DATASETS` (case and ``_``/``-`` ignored), or None."""
    if dataset is None:
        return None
    key = str(dataset).strip().lower().replace("_", "-")
    if key not in _DATASET_ALIASES:
        raise ValueError(f"dataset must be one of {list(DATASETS)} or None, got {dataset!r}")
    return _DATASET_ALIASES[key]


def _check_verify(verify: bool | str) -> None:
    if not (isinstance(verify, bool) or verify == "strict"):
        raise ValueError(f"verify must be True, False or 'strict', got {verify!r}")


def _verify_files(
    files: list[tuple[Path, bytes]], dataset: str | None, strict: bool
) -> str | None:
    """Check ``files`` (path, raw bytes) against :data:`KNOWN_SHA256`.

    The dataset is ``dataset`` when given, else the one whose published file a
    file's hash matches. A ``.gz`` original of a known dataset must match its
    published hash. Files with no published hash to compare with (an
    uncompressed copy, or nothing recognised) only log a warning, or raise
    when ``strict``. Returns the dataset (None when unknown).
    """
    digests = [hashlib.sha256(raw).hexdigest() for _, raw in files]
    if dataset is None:
        found = {}
        for (path, _), digest in zip(files, digests):
            if digest in _BY_SHA256:
                found.setdefault(_BY_SHA256[digest][0], path)
        if len(found) > 1:
            which = ", ".join(f"{path} is {_PRETTY[ds]}" for ds, path in sorted(found.items()))
            raise ValueError(f"files from different datasets in one split: {which}")
        dataset = next(iter(found), None)

    unverified = []
    for (path, _), digest in zip(files, digests):
        expected = KNOWN_SHA256.get((dataset, path.name)) if dataset else None
        if expected is None:
            unverified.append((path, digest))
            continue
        if digest != expected:
            hint = ""
            if digest in _BY_SHA256:
                ds, name = _BY_SHA256[digest]
                hint = f"; its content is the {_PRETTY[ds]} file {name}"
            raise ValueError(
                f"{path}: sha256 mismatch for {_PRETTY[dataset]} {path.name}: "
                f"expected {expected}, got {digest}{hint} "
                "(the file is corrupt or not the original; verify=False skips this check)"
            )
    for path, digest in unverified:
        if dataset is None:
            why = "matches no published MNIST or Fashion-MNIST file"
        else:
            why = f"is not a published {_PRETTY[dataset]} .gz original, so it has no known hash"
        if strict:
            raise ValueError(f"{path}: cannot verify (sha256 {digest}) - it {why} (verify='strict')")
        logger.warning("%s: checksum not verified: it %s (sha256 %s)", path, why, digest)
    if dataset is not None:
        logger.debug("verified %s against the published %s hashes", [str(p) for p, _ in files],
                     _PRETTY[dataset])
    return dataset


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
    directory: str | os.PathLike[str],
    split: str = "train",
    *,
    dataset: str | None = None,
    verify: bool | str = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Load an MNIST-style split (images and labels) from a folder, checking its checksums.

    Parameters
    ----------
    directory : str or os.PathLike
        Folder with ``train-images-idx3-ubyte[.gz]``,
        ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]`` and
        ``t10k-labels-idx1-ubyte[.gz]``.
    split : {"train", "test"}
        Which pair of files to read.
    dataset : {"mnist", "fashion-mnist"} or None
        Which dataset the files must be. None: recognised from the hashes
        (a file that matches a published MNIST or Fashion-MNIST file decides
        it, and the other file of the split must then match too).
    verify : bool or "strict"
        True (default): once the dataset is known, each ``.gz`` original must
        have its published sha256 (:data:`KNOWN_SHA256`); files with no
        published hash (an uncompressed copy, or an unrecognised set of
        files) are read with a logged warning. "strict": such files raise
        too. False: no hashing.

    Returns
    -------
    images : numpy.ndarray
        ``uint8`` array ``(N, H, W)`` (28x28 for MNIST and Fashion-MNIST).
    labels : numpy.ndarray
        ``uint8`` array ``(N,)``.

    Raises
    ------
    ValueError
        On an unknown split, dataset or verify value; a sha256 mismatch (the
        message names the file, the expected and the actual hash); a file
        that cannot be verified under ``verify="strict"``; malformed files;
        or images and labels that do not match (type, rank or count).
    FileNotFoundError
        If a file is missing.
    """
    if split not in IDX_FILES:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(IDX_FILES)}")
    dataset = _canonical_dataset(dataset)
    _check_verify(verify)
    d = Path(directory)
    img_stem, lbl_stem = IDX_FILES[split]
    img_path, lbl_path = _find(d, img_stem), _find(d, lbl_stem)
    files = [(img_path, img_path.read_bytes()), (lbl_path, lbl_path.read_bytes())]
    if verify:
        dataset = _verify_files(files, dataset, strict=verify == "strict")
    images, labels = (parse_idx(_decode(raw, path), source=str(path)) for path, raw in files)
    del files
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
        "loaded %s split from %s%s: %d images %s", split, d,
        f" ({_PRETTY[dataset]})" if dataset else "", images.shape[0], images.shape[1:],
    )
    return images, labels


def _has_split(directory: Path, split: str) -> bool:
    return any((directory / (stem + ext)).is_file() for stem in IDX_FILES[split] for ext in ("", ".gz"))


def _load_named(
    directory: str | os.PathLike[str], split: str, dataset: str, verify: bool | str
) -> tuple[np.ndarray, np.ndarray]:
    d = Path(directory)
    if split in IDX_FILES and not _has_split(d, split) and (d / dataset).is_dir():
        d = d / dataset  # the parent data folder, e.g. shared/data with mnist/ in it
    images, labels = load_idx_dataset(d, split, dataset=dataset, verify=verify)
    if images.shape[1:] != (28, 28):
        raise ValueError(f"{d}: expected 28x28 {_PRETTY[dataset]} images, got {images.shape[1:]}")
    if labels.size and int(labels.max()) > 9:
        raise ValueError(f"{d}: {_PRETTY[dataset]} labels must be 0..9, found {int(labels.max())}")
    x = images.astype(np.float32)
    x /= np.float32(255.0)
    return x, labels.astype(np.int64)


def load_mnist(
    directory: str | os.PathLike[str], split: str = "train", *, verify: bool | str = True
) -> tuple[np.ndarray, np.ndarray]:
    """MNIST as ``x`` float32 ``(N, 28, 28)`` in [0, 1] and ``y`` int64 ``(N,)``.

    ``directory`` holds the IDX files, or is a folder with an ``mnist/``
    sub-folder that holds them. The ``.gz`` originals are checked against the
    published hashes (see :func:`load_idx_dataset` for ``verify``).
    """
    return _load_named(directory, split, "mnist", verify)


def load_fashion_mnist(
    directory: str | os.PathLike[str], split: str = "train", *, verify: bool | str = True
) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST as ``x`` float32 ``(N, 28, 28)`` in [0, 1] and ``y`` int64 ``(N,)``.

    ``directory`` holds the IDX files, or is a folder with a
    ``fashion-mnist/`` sub-folder that holds them. The ``.gz`` originals are
    checked against the published hashes (see :func:`load_idx_dataset`).
    """
    return _load_named(directory, split, "fashion-mnist", verify)
