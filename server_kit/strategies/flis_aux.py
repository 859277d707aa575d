"""The server's labelled auxiliary set of FLIS, and the reduction of a client's model to its predictions on it.

:class:`AuxInference` is the part both FLIS variants share: it reads and
checks the set, runs each model on it (torch when installed, else ONNX
Runtime on the architecture's shipped classifier template) and computes the
inference similarity of a round's models.
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Update
from edge_sdk.validation import check_choice, check_number

from .base import ClientInfo, Weights
from .flis_math import PREDICTIONS, inference_similarity, prediction_matrix, softmax

__all__ = ["AuxInference", "INFERENCE", "aux_logits", "check_aux", "load_aux"]

#: FLIS's logger: the lines of both variants keep one name.
log = logging.getLogger("server_kit.strategies.flis")

#: Runtimes for the server-side inference.
INFERENCE: tuple[str, ...] = ("auto", "torch", "onnx")

#: Auxiliary samples per forward pass.
_BATCH = 256


def load_aux(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Arrays ``x`` and ``y`` of an ``.npz`` file, read without pickle.

    Raises
    ------
    FileNotFoundError
        If there is no such file.
    ValueError
        If the file is not an ``.npz`` archive of plain arrays holding ``x`` and ``y``.
    """
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"aux_path {p!r}: no such file")
    try:
        with np.load(p, allow_pickle=False) as f:
            if not hasattr(f, "files"):
                raise ValueError(f"aux_path {p!r} is a single .npy array; expected an .npz archive with x and y")
            missing = [k for k in ("x", "y") if k not in f.files]
            if missing:
                raise ValueError(f"aux_path {p!r} lacks array(s) {missing}; it holds {sorted(f.files)}")
            return np.array(f["x"]), np.array(f["y"])
    except ValueError as e:
        if "pickle" in str(e):
            raise ValueError(f"aux_path {p!r} holds pickled or object data, which is refused; "
                             "save plain numeric arrays with numpy.savez") from e
        raise
    except (zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"aux_path {p!r} is not a readable .npz archive: {e}") from e


def check_aux(x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    """The auxiliary samples as float32 and labels as int64, or a ValueError saying what is wrong."""
    xa, ya = np.asarray(x), np.asarray(y)
    if xa.dtype == object or ya.dtype == object:
        raise ValueError("aux_x and aux_y must be numeric arrays, not object arrays")
    if not np.issubdtype(xa.dtype, np.floating):
        raise ValueError(f"aux_x must be a floating-point array (images in [0, 1]), got dtype {xa.dtype}")
    if xa.ndim < 2 or xa.shape[0] < 1:
        raise ValueError(f"aux_x must be (n, ...) with at least one sample, got shape {xa.shape}")
    if not np.isfinite(xa).all():
        raise ValueError("aux_x contains NaN or Inf")
    if ya.ndim != 1 or ya.shape[0] != xa.shape[0]:
        raise ValueError(f"aux_y must be 1-D with one label per sample of aux_x ({xa.shape[0]}), got shape {ya.shape}")
    if not np.issubdtype(ya.dtype, np.integer):
        raise ValueError(f"aux_y must hold integer class labels, got dtype {ya.dtype}")
    if ya.min() < 0:
        raise ValueError(f"aux_y must hold non-negative class labels, got {int(ya.min())}")
    return np.ascontiguousarray(xa, dtype=np.float32), ya.astype(np.int64)


def aux_logits(architecture: str, weights: Weights, x: np.ndarray, y: np.ndarray, *, runtime: str,
               models_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """``(m, C)`` logits of ``weights`` on the auxiliary samples, with torch or ONNX Runtime.

    Uses the evaluation paths of :mod:`edge_sdk.training.evaluation`, which check the
    weights against the architecture and the samples against its input.
    """
    from edge_sdk.training.evaluation import onnx_logits, torch_logits

    if runtime == "torch":
        logits, _ = torch_logits(architecture, weights, x, y, _BATCH, "cpu", None)
    elif runtime == "onnx":
        logits, _ = onnx_logits(architecture, weights, x, y, _BATCH, models_dir, None)
    else:
        raise ValueError(f"runtime must be 'torch' or 'onnx', got {runtime!r}")
    return np.asarray(logits, dtype=np.float64)


class AuxInference:
    """The server's auxiliary set and the reduction of a model to its predictions on it (both variants' mixin)."""

    def __init__(self, *, architecture: str | None = None, aux_path: str | os.PathLike[str] | None = None,
                 aux_x: np.ndarray | None = None, aux_y: np.ndarray | None = None, inference: str = "auto",
                 predictions: str = "hard", temperature: float = 1.0,
                 models_dir: str | os.PathLike[str] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        if not architecture or not isinstance(architecture, str):
            raise ValueError(f"{self.name} runs the clients' models on the server's auxiliary set: give "
                             f"architecture (a classifier key of edge_sdk.training.nets), got {architecture!r}")
        check_choice(inference, "inference", INFERENCE, INFERENCE)
        check_choice(predictions, "predictions", PREDICTIONS, PREDICTIONS)
        from edge_sdk.training.trainer import torch_available

        if inference == "torch" and not torch_available():
            raise ValueError("inference='torch' needs torch, which is not installed; use 'onnx' or 'auto'")
        if aux_path is not None and (aux_x is not None or aux_y is not None):
            raise ValueError("give either aux_path or aux_x and aux_y, not both")
        if aux_path is None and (aux_x is None or aux_y is None):
            raise ValueError(f"{self.name} needs the server's labelled auxiliary set: give aux_path (an .npz "
                             "with arrays x and y) or both aux_x and aux_y")
        x, y = load_aux(aux_path) if aux_path is not None else (aux_x, aux_y)
        self.architecture = architecture
        self.aux_path = None if aux_path is None else os.fspath(aux_path)
        self.inference = inference
        self.predictions = predictions
        self.temperature = check_number(temperature, "temperature", low=0.0, low_open=True)
        self.models_dir = None if models_dir is None else os.fspath(models_dir)
        self.aux_x_, self.aux_y_ = check_aux(x, y)
        #: The runtime actually used ("torch" or "onnx").
        self.runtime_ = "torch" if inference == "torch" or (inference == "auto" and torch_available()) else "onnx"
        #: Accuracy on the auxiliary set of the latest model seen from each client (for the logs).
        self.aux_accuracy_: dict[str, float] = {}

    def setup(self, clients: Sequence[ClientInfo], template: Weights) -> None:
        """As the base; also runs the template on the auxiliary set once, so a misfit fails here."""
        super().setup(clients, template)  # type: ignore[misc]
        try:
            self.aux_predictions(template)
        except ValueError as e:
            raise ValueError(f"{self.name}: the auxiliary set does not fit architecture "
                             f"{self.architecture!r}: {e}") from e

    def aux_predictions(self, weights: Weights, cid: str | None = None) -> np.ndarray:
        """``(m, C)`` float32 softmax probabilities of ``weights`` on the auxiliary set."""
        z = aux_logits(self.architecture, weights, self.aux_x_, self.aux_y_, runtime=self.runtime_,
                       models_dir=self.models_dir)
        if cid is not None:
            self.aux_accuracy_[cid] = float(np.mean(np.argmax(z, axis=1) == self.aux_y_))
        return softmax(z, self.temperature).astype(np.float32)

    def _reduce(self, rnd: int, updates: Sequence[Update]) -> list[tuple[Update, np.ndarray]]:
        """Each update with its predictions; an update whose inference fails is logged and left out."""
        out = []
        for u in updates:
            try:
                out.append((u, self.aux_predictions(u.weights, u.cid)))
            except ValueError as e:
                log.warning("%s round %d: update of %s not used for clustering: %s", self.name, rnd, u.cid, e)
        return out

    def _similarity(self, probs: Sequence[np.ndarray]) -> np.ndarray:
        return inference_similarity(np.stack([prediction_matrix(p, self.predictions) for p in probs]))
