"""A trained model as a folder: the one format the server exports and a device keeps.

A model folder holds ``weights.safetensors`` (the ``state_dict``, written by
:func:`weights_bytes`, so that the same weights give the same bytes and the
same sha256 on the server and on every device), ``model.json`` (a
:class:`ModelEntry`: which run and model it is, its architecture and input,
the server's and the device's accuracy, the sha256 of every other file) and,
in the server's export, ``model.onnx`` (the classifier with these weights in
it: ONNX Runtime runs it with no other file). ``model.json`` is written last;
:func:`read_model_folder` checks every file against it before anything is
used, and says what is wrong in one line (:class:`ModelFolderError`).

:func:`swap_link` is the one atomic switch of a folder that readers follow
by name (the server's ``models`` link, a device's ``current`` and
``previous``): a symbolic link replaced with :func:`os.replace`, so that a
reader sees the old folder or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ENTRY",
    "FORMAT",
    "ONNX",
    "WEIGHTS",
    "ModelEntry",
    "ModelFolderError",
    "read_model_folder",
    "swap_link",
    "weights_bytes",
    "weights_sha256",
    "write_model_folder",
]

#: The format a ``model.json`` says it is in.
FORMAT = "fedsketch-model/1"
WEIGHTS = "weights.safetensors"
ONNX = "model.onnx"
ENTRY = "model.json"


class ModelFolderError(ValueError):
    """A model folder that cannot be used: missing, truncated, corrupt, or for another model (one line)."""


@dataclass(frozen=True)
class ModelEntry:
    """What ``model.json`` says of the model in its folder."""

    #: The model's key in its run (``c0``, ``ifca1``, ``global``...).
    key: str
    architecture: str
    #: The shape of one sample and the number of classes.
    input_shape: tuple[int, ...]
    num_classes: int
    #: The names of the classifier's ONNX input and output.
    input_name: str = "x"
    output_name: str = "logits"
    #: The run that trained it, its strategy, the cluster index of the key (None: no clustering).
    run: str | None = None
    strategy: str | None = None
    cluster: int | None = None
    #: The training round its weights come from, and its version when the run versions its models.
    round: int = 0
    version: int | None = None
    #: Devices of the cluster and their samples (as the server registered them).
    members: int | None = None
    samples: int | None = None
    #: The server's accuracy of the model: the mean over the devices that evaluated it, and their count.
    server_accuracy: float | None = None
    server_evaluated: int = 0
    #: The device's own accuracy on its own test split, and that split's size (a kept model only).
    device_accuracy: float | None = None
    device_test_n: int = 0
    #: When it was written (UTC, ISO 8601).
    written_at: str = ""
    #: The sha256 of every other file of the folder.
    files: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape)
        return out

    @classmethod
    def from_dict(cls, raw: Any, where: str = "model.json") -> ModelEntry:
        """The entry in ``raw`` (a parsed ``model.json``), checked; :class:`ModelFolderError` if unfit."""
        if not isinstance(raw, dict):
            raise ModelFolderError(f"{where}: not a JSON object")
        if raw.get("format") != FORMAT:
            raise ModelFolderError(f"{where}: format {raw.get('format')!r}, this FedSketch reads {FORMAT!r}")
        names = {f for f in cls.__dataclass_fields__}
        try:
            kw = {k: v for k, v in raw.items() if k in names}
            kw["input_shape"] = tuple(int(d) for d in kw["input_shape"])
            kw["num_classes"] = int(kw["num_classes"])
            entry = cls(**kw)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFolderError(f"{where}: {type(e).__name__}: {e}") from None
        if not isinstance(entry.key, str) or not isinstance(entry.architecture, str):
            raise ModelFolderError(f"{where}: key and architecture must be strings")
        if not entry.input_shape or min(entry.input_shape) < 1 or entry.num_classes < 1:
            raise ModelFolderError(f"{where}: input shape {entry.input_shape} or {entry.num_classes} classes unfit")
        if not isinstance(entry.files, dict) or WEIGHTS not in entry.files:
            raise ModelFolderError(f"{where}: names no sha256 for {WEIGHTS}")
        return entry


def weights_bytes(weights: Mapping[str, np.ndarray]) -> bytes:
    """The safetensors bytes of ``weights``: the same weights give the same bytes on every machine."""
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(weights[k]) for k in sorted(weights)})


def weights_sha256(weights: Mapping[str, np.ndarray]) -> str:
    """The sha256 of :func:`weights_bytes` (what ``model.json`` records, and a keep command names)."""
    return hashlib.sha256(weights_bytes(weights)).hexdigest()


def _write(path: Path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_model_folder(folder: str | Path, entry: ModelEntry, weights: Mapping[str, np.ndarray],
                       onnx: bytes | None = None) -> ModelEntry:
    """Write a model folder (created, or overwritten file by file) and return the entry it holds.

    The weights and the ONNX file go first, ``model.json`` with their sha256 last: a folder without
    ``model.json`` is one being written. Raises OSError (a full or read-only disk) as it comes.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    files = {WEIGHTS: _write(out / WEIGHTS, weights_bytes(weights))}
    if onnx is not None:
        files[ONNX] = _write(out / ONNX, onnx)
    done = replace(entry, files=files, written_at=entry.written_at or now_iso())
    _write(out / ENTRY, (json.dumps(done.to_dict(), indent=1) + "\n").encode())
    return done


def read_model_folder(folder: str | Path, *, check_onnx: bool = True
                      ) -> tuple[ModelEntry, dict[str, np.ndarray]]:
    """The entry and weights of a model folder, its weights (and ONNX file) checked against their sha256.

    Raises
    ------
    ModelFolderError
        A missing folder or file, a truncated or changed file (its sha256), an entry that is not one,
        or weights that do not load.
    """
    d = Path(folder)
    if not d.is_dir():
        raise ModelFolderError(f"{d}: no such model folder")
    try:
        raw = json.loads((d / ENTRY).read_text())
    except FileNotFoundError:
        raise ModelFolderError(f"{d}: no {ENTRY} (not a model folder, or one still being written)") from None
    except (OSError, ValueError) as e:
        raise ModelFolderError(f"{d / ENTRY}: cannot be read ({e})") from None
    entry = ModelEntry.from_dict(raw, str(d / ENTRY))
    data = None
    for name, sha in entry.files.items():
        if name not in (WEIGHTS, ONNX) or (name == ONNX and not check_onnx):
            continue
        try:
            blob = (d / name).read_bytes()
        except OSError as e:
            raise ModelFolderError(f"{d / name}: cannot be read ({e.strerror or e})") from None
        if hashlib.sha256(blob).hexdigest() != str(sha).lower():
            raise ModelFolderError(f"{d / name}: sha256 {hashlib.sha256(blob).hexdigest()[:16]}... does not "
                                   f"match {str(sha)[:16]}... in {ENTRY} (truncated or changed)")
        if name == WEIGHTS:
            data = blob
    from safetensors.numpy import load

    try:
        weights = load(data or b"")
    except Exception as e:  # safetensors raises its own error types
        raise ModelFolderError(f"{d / WEIGHTS}: not safetensors ({e})") from None
    return entry, weights


def swap_link(link: str | Path, target: str | Path) -> None:
    """Point the symbolic link ``link`` at ``target`` in one step (a reader sees the old or the new).

    ``target`` is made relative to the link's folder, so the pair moves with its folder. A real folder
    in the link's place (from before links were used) is removed first.
    """
    link = Path(link)
    rel = os.path.relpath(Path(target), link.parent)
    if link.exists() and not link.is_symlink():
        import shutil

        shutil.rmtree(link)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(rel, tmp)
    os.replace(tmp, link)
