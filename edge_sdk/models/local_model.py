"""A trained model in the owner's application: :class:`LocalModel` (ONNX Runtime only, no torch).

    from edge_sdk import LocalModel
    model = LocalModel.load("/var/lib/fedsketch/model")   # a device's model folder, or one exported model
    labels = model.predict(x)                              # int64 class per sample
    proba = model.predict_proba(x)                         # softmax, (n, num_classes)
    model.reload()                                         # True when a newer kept model was taken

``load`` takes a device's model folder (``fedsketch-client --model-dir``: its
``current`` link is followed) or one model folder (``model.json`` inside,
as the server exports them in ``REPORT_DIR/models/KEY``). Every file is
checked against its sha256 and the model against its architecture before
anything runs (:class:`~edge_sdk.models.model_folder.ModelFolderError`, one line).
A standalone ``model.onnx`` runs as it is; without one, the architecture's
shipped ONNX template runs with the kept weights in it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..training.evaluation import OnnxClassifier, onnx_classifier
from .model_checks import ModelInfo, check_samples
from .model_folder import ENTRY, ONNX, ModelEntry, ModelFolderError, read_model_folder

__all__ = ["LocalModel", "resolve_model_folder"]

log = logging.getLogger(__name__)

#: The link of a device's model folder to the model it keeps now (and to the one before).
CURRENT = "current"
PREVIOUS = "previous"


def resolve_model_folder(path: str | os.PathLike[str]) -> Path:
    """The model folder ``path`` names: itself (``model.json`` inside) or its ``current`` link's target."""
    p = Path(path)
    if (p / ENTRY).is_file():
        return p
    if (p / CURRENT).exists():
        return (p / CURRENT).resolve()
    if (p / "weights.safetensors").is_file():
        raise ModelFolderError(f"{p}: no {ENTRY} (not a model folder, or one still being written)")
    if p.is_dir():
        raise ModelFolderError(f"{p}: holds no model (neither {ENTRY} nor a {CURRENT!r} model)")
    raise ModelFolderError(f"{p}: no such model folder")


@dataclass(frozen=True)
class _Loaded:
    folder: Path
    entry: ModelEntry
    classifier: OnnxClassifier


def _load(folder: Path, threads: int | None) -> _Loaded:
    entry, weights = read_model_folder(folder)
    try:
        onnx_file = folder / ONNX if ONNX in entry.files else None
        clf = onnx_classifier(entry.architecture, weights, threads=threads, onnx_file=onnx_file)
        if onnx_file is not None:  # the standalone file's weights: also the architecture's
            from .model_checks import check_weights

            check_weights(clf.info, weights)
    except ModelFolderError:
        raise
    except Exception as e:  # an unknown architecture, weights of another shape, an ONNX file ORT refuses
        raise ModelFolderError(f"{folder}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if onnx_file is not None:  # the file itself: its input and output as model.json says
        inp, out = clf.session.get_inputs()[0], clf.session.get_outputs()[0]
        if inp.name != entry.input_name or out.name != entry.output_name or \
                [d if isinstance(d, int) else -1 for d in inp.shape[1:]] != list(entry.input_shape):
            raise ModelFolderError(f"{folder / ONNX}: takes {inp.name} {inp.shape} and gives {out.name}, "
                                   f"{ENTRY} says {entry.input_name} {list(entry.input_shape)} and {entry.output_name}")
    if tuple(clf.info.input_shape) != tuple(entry.input_shape) or clf.info.num_classes != entry.num_classes:
        raise ModelFolderError(
            f"{folder}: {ENTRY} says input {list(entry.input_shape)} and {entry.num_classes} classes, "
            f"architecture {entry.architecture} takes {list(clf.info.input_shape)} and {clf.info.num_classes}")
    return _Loaded(folder, entry, clf)


class LocalModel:
    """A kept or exported model, run with ONNX Runtime; :meth:`load` makes one (see the module docstring).

    Thread-safe: :meth:`reload` swaps the session while other threads predict (a prediction under way
    finishes on the model it began with).
    """

    def __init__(self, path: Path, loaded: _Loaded, threads: int | None) -> None:
        self.path = path
        self._loaded = loaded
        self._threads = threads
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, threads: int | None = None) -> LocalModel:
        """The model of ``path`` (a device's model folder or one model folder), checked.

        Raises
        ------
        ModelFolderError
            Missing, truncated or corrupt files, or a model for another architecture or input shape.
        """
        p = Path(path)
        return cls(p, _load(resolve_model_folder(p), threads), threads)

    @property
    def info(self) -> ModelEntry:
        """What the model's ``model.json`` says: run, key, version, accuracies, architecture, input."""
        return self._loaded.entry

    @property
    def classifier_info(self) -> ModelInfo:
        """The classifier's architecture, input shape, classes and weights' names (what its data is checked against)."""
        return self._loaded.classifier.info

    @property
    def folder(self) -> Path:
        """The model folder in use (a device's ``current`` target)."""
        return self._loaded.folder

    def logits(self, x: Any) -> np.ndarray:
        """The ``(n, num_classes)`` logits of samples ``x`` (ValueError on a wrong shape, dtype or range)."""
        loaded = self._loaded
        return loaded.classifier.logits(check_samples(loaded.classifier.info, x))

    def predict_proba(self, x: Any) -> np.ndarray:
        """The softmax of the logits, ``(n, num_classes)``, float64."""
        z = self.logits(x).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def predict(self, x: Any) -> np.ndarray:
        """The predicted class of each sample, int64 ``(n,)``."""
        return np.argmax(self.logits(x), axis=1).astype(np.int64)

    def reload(self) -> bool:
        """Take the model the folder keeps now, if another; returns whether it changed.

        A folder that cannot be used now (being swapped, or broken) leaves the model in use as it was
        (logged); the next call tries again.
        """
        with self._lock:
            try:
                folder = resolve_model_folder(self.path)
                if folder == self._loaded.folder:
                    return False
                loaded = _load(folder, self._threads)
            except ModelFolderError as e:
                log.warning("model not reloaded, the one in use stays: %s", e)
                return False
            self._loaded = loaded
        log.info("model reloaded: %s (run %s, key %s)", folder, loaded.entry.run, loaded.entry.key)
        return True

    def __repr__(self) -> str:
        e = self.info
        return f"LocalModel({str(self.folder)!r}, key={e.key!r}, run={e.run!r}, architecture={e.architecture!r})"
