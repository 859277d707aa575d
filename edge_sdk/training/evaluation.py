"""Evaluation of received classifier weights on local data: accuracy and cross-entropy.

:func:`evaluate` runs the torch model when torch is installed. Without torch
(a device that only sketches and evaluates) it runs the architecture's
shipped ONNX classifier template with ONNX Runtime, its initializers
replaced by the received weights through
:meth:`onnxruntime.SessionOptions.add_initializer`. The manifest entry's
``initializer_names`` maps each ``state_dict`` key to the ONNX initializer
that holds it (the export recipe checks it is stored unchanged). The session
runs at ``ORT_ENABLE_EXTENDED``: at ``ORT_ENABLE_ALL`` the NCHWc layout
transformer bakes the file's own convolution filters in and the overrides of
those are ignored. Both paths give the same accuracy and losses within about
1e-6. :func:`torch_logits` and :func:`onnx_logits` are the two paths'
logits, for the server's use of them (FLIS).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..models.artifacts import artifact_path, load_manifest, sha256_file
from ..models.artifacts import models_dir as default_models_dir
from ..models.model_checks import ModelInfo, check_data, check_weights, state_spec
from ..validation import check_positive_int
from .torch_support import build_classifier, import_torch, torch_available, using_threads

__all__ = ["EvalResult", "OnnxClassifier", "classifier_io", "classifier_template", "evaluate", "onnx_classifier", "onnx_logits", "torch_logits"]


@dataclass(frozen=True)
class EvalResult:
    """What :func:`evaluate` returns: accuracy in [0, 1], mean cross-entropy, sample count."""

    accuracy: float
    loss: float
    n: int


def _cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy (float64, log-sum-exp) and accuracy of ``logits`` for labels ``y``."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=1)) + m[:, 0]
    loss = float(np.mean(lse - z[np.arange(len(y)), y]))
    accuracy = float(np.mean(np.argmax(z, axis=1) == y))
    return loss, accuracy


# --------------------------------------------------------------------------- torch side


def torch_logits(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: Any,
    y: Any,
    batch_size: int,
    device: str,
    threads: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Logits of ``weights`` on ``x`` with the torch model (needs torch).

    Parameters
    ----------
    architecture : str
        Classifier architecture key (``"digits_cnn_1x8x8_10"``, ...).
    weights : mapping of str to numpy.ndarray
        A ``state_dict`` matching the architecture (checked).
    x, y : array-like
        Samples and labels (checked), as for :func:`edge_sdk.training.trainer.train_local`.
    batch_size : int
        Samples per forward pass.
    device : str
        Torch device.
    threads : int or None
        Intra-op threads (None: the runtime's choice).

    Returns
    -------
    tuple of numpy.ndarray
        The ``(n, num_classes)`` logits and the checked int64 labels.
    """
    torch = import_torch()
    model, info = build_classifier(architecture)
    w = check_weights(info, weights)
    xa, ya = check_data(info, x, y)
    dev = torch.device(device)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
    model.to(dev).eval()
    chunks = []
    with using_threads(torch, threads), torch.no_grad():
        for start in range(0, xa.shape[0], batch_size):
            xb = torch.from_numpy(xa[start : start + batch_size]).to(dev)
            chunks.append(model(xb).float().cpu().numpy())
    return np.concatenate(chunks), ya


# --------------------------------------------------------------------------- ONNX Runtime side


@dataclass(frozen=True)
class _OnnxTemplate:
    """An architecture's shipped ONNX classifier and how received weights map onto it."""

    path: Path
    info: ModelInfo
    initializers: dict[str, str]
    input_name: str
    output_name: str


@functools.lru_cache(maxsize=16)
def _onnx_template_cached(directory: str, architecture: str, stamp: int) -> _OnnxTemplate:
    """Find, check (sha256) and read the classifier template of ``architecture`` in ``directory``."""
    del stamp  # part of the cache key only: a rewritten manifest is read again
    d = Path(directory)
    manifest = load_manifest(d)
    found = [
        s
        for s in manifest.values()
        if s.role == "classifier" and (s.extra or {}).get("architecture") == architecture
    ]
    if not found:
        known = sorted(
            str((s.extra or {}).get("architecture"))
            for s in manifest.values()
            if s.role == "classifier"
        )
        raise ValueError(
            f"unknown architecture {architecture!r}: no classifier template in "
            f"{d / 'manifest.json'} has it (classifiers there: {known})"
        )
    path, spec = artifact_path(found[0].name, d)  # checks the sha256
    extra = spec.extra or {}
    weights_entry = extra.get("weights") or {}
    if "file" not in weights_entry:
        raise ValueError(f"manifest entry {spec.name!r} names no weights file")
    weights_path = d / weights_entry["file"]
    if weights_entry.get("sha256") and sha256_file(weights_path) != weights_entry["sha256"]:
        raise ValueError(
            f"{weights_path} does not match the sha256 in the manifest; rebuild it with: "
            f"{spec.recipe or 'its recipe'}"
        )
    from safetensors.numpy import load_file

    template_spec = state_spec(load_file(str(weights_path)))
    names = extra.get("initializer_names")
    if names is None:  # manifests written before the map existed: names were kept
        names = {k: k for k, (_, dt) in template_spec.items() if np.dtype(dt).kind == "f"}
    uncovered = [
        k for k, (_, dt) in template_spec.items() if np.dtype(dt).kind == "f" and k not in names
    ]
    if uncovered:
        raise ValueError(
            f"classifier template {spec.name!r} does not expose {uncovered[:5]} as ONNX "
            "initializers; received weights cannot be evaluated with ONNX Runtime"
        )
    if spec.num_classes is None:
        raise ValueError(f"manifest entry {spec.name!r} lacks num_classes")
    info = ModelInfo(
        architecture=architecture,
        input_shape=spec.input_shape,
        num_classes=spec.num_classes,
        spec=dict(template_spec),
    )
    return _OnnxTemplate(path, info, dict(names), spec.input_name, spec.output_name)


def _onnx_template(architecture: str, models_dir: str | os.PathLike[str] | None) -> _OnnxTemplate:
    """The cached template, read again when the manifest file changes."""
    d = Path(models_dir) if models_dir is not None else default_models_dir()
    stamp = (d / "manifest.json").stat().st_mtime_ns
    return _onnx_template_cached(str(d.resolve()), architecture, stamp)


def classifier_template(architecture: str, models_dir: str | os.PathLike[str] | None = None) -> _OnnxTemplate:
    """``architecture``'s shipped ONNX classifier (sha256 checked): its path, info and initializer names."""
    return _onnx_template(architecture, models_dir)


def classifier_io(architecture: str, models_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What a model folder records of ``architecture``'s shipped classifier: its input shape, classes, names."""
    tpl = _onnx_template(architecture, models_dir)
    return {"input_shape": tuple(tpl.info.input_shape), "num_classes": tpl.info.num_classes,
            "input_name": tpl.input_name, "output_name": tpl.output_name}


class OnnxClassifier:
    """One ONNX Runtime session of a classifier: a standalone ``.onnx`` file, or a template with weights.

    Made by :func:`onnx_classifier`; :meth:`logits` runs it. The session is
    thread-safe for :meth:`logits`; the arrays its overridden initializers
    wrap are kept with it (ONNX Runtime does not copy them).
    """

    def __init__(self, session: Any, info: ModelInfo, input_name: str, output_name: str,
                 keep: list[Any]) -> None:
        self.session = session
        self.info = info
        self.input_name = input_name
        self.output_name = output_name
        self._keep = keep

    def logits(self, xa: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """The ``(n, num_classes)`` logits of checked samples ``xa`` (float32, ``(n, *input_shape)``)."""
        chunks = []
        for start in range(0, xa.shape[0], batch_size):
            chunk = xa[start : start + batch_size]
            chunks.append(np.asarray(self.session.run([self.output_name], {self.input_name: chunk})[0]))
        return np.concatenate(chunks).reshape(xa.shape[0], -1)


def _session_options(threads: int | None) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # Not ORT_ENABLE_ALL: its NCHWc layout transformer reorders convolution
    # filters from the model file's own initializers, so overrides of
    # convolution weights were silently ignored (onnxruntime 1.31.1).
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    if threads is not None:
        opts.intra_op_num_threads = check_positive_int(threads, "threads")
        opts.inter_op_num_threads = 1
    return opts


def onnx_classifier(architecture: str, weights: Mapping[str, np.ndarray] | None = None, *,
                    models_dir: str | os.PathLike[str] | None = None, threads: int | None = None,
                    onnx_file: str | os.PathLike[str] | None = None) -> OnnxClassifier:
    """An ONNX Runtime session of ``architecture``: the shipped template with ``weights`` in it (checked),
    or, with ``onnx_file``, that standalone classifier (its weights inside; ``weights`` then unused).
    """
    import onnxruntime as ort

    tpl = _onnx_template(architecture, models_dir)
    opts = _session_options(threads)
    keep: list[Any] = []
    if onnx_file is None:
        if weights is None:
            raise ValueError("onnx_classifier needs weights or an onnx_file")
        w = check_weights(tpl.info, weights)
        for key, init_name in tpl.initializers.items():
            arr = np.asarray(w[key], order="C")
            value = ort.OrtValue.ortvalue_from_numpy(arr)
            keep.append((arr, value))
            opts.add_initializer(init_name, value)
    path = str(onnx_file if onnx_file is not None else tpl.path)
    session = ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])
    return OnnxClassifier(session, tpl.info, tpl.input_name, tpl.output_name, keep)


def onnx_logits(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: Any,
    y: Any,
    batch_size: int,
    models_dir: str | os.PathLike[str] | None,
    threads: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Logits of ``weights`` on ``x`` with the shipped ONNX template in ONNX Runtime (no torch).

    Parameters
    ----------
    architecture : str
        Classifier architecture key (``"digits_cnn_1x8x8_10"``, ...).
    weights : mapping of str to numpy.ndarray
        A ``state_dict`` matching the architecture (checked).
    x, y : array-like
        Samples and labels (checked), as for :func:`edge_sdk.training.trainer.train_local`.
    batch_size : int
        Samples per forward pass.
    models_dir : str or os.PathLike or None
        Folder of the manifest and templates (None: the installed artifacts).
    threads : int or None
        Intra-op threads (None: the runtime's choice).

    Returns
    -------
    tuple of numpy.ndarray
        The ``(n, num_classes)`` logits and the checked int64 labels.
    """
    clf = onnx_classifier(architecture, weights, models_dir=models_dir, threads=threads)
    xa, ya = check_data(clf.info, x, y)
    return clf.logits(xa, batch_size), ya


def evaluate(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int = 256,
    force_onnx: bool = False,
    models_dir: Optional[str | os.PathLike[str]] = None,
    device: str = "cpu",
    threads: Optional[int] = None,
) -> EvalResult:
    """Accuracy and mean cross-entropy of ``weights`` on ``(x, y)``.

    With torch installed the torch model runs; otherwise (or with
    ``force_onnx=True``) the architecture's shipped ONNX classifier template
    (the manifest entry with role ``classifier`` and this ``architecture``)
    runs in ONNX Runtime with its initializers replaced by ``weights``.

    Parameters
    ----------
    architecture : str
        Classifier architecture key (``"digits_cnn_1x8x8_10"``, ...).
    weights : mapping of str to numpy.ndarray
        A ``state_dict`` matching the architecture.
    x, y : numpy.ndarray
        Samples and labels, as for :func:`edge_sdk.training.trainer.train_local`.
    batch_size : int
        Samples per forward pass.
    force_onnx : bool
        Use ONNX Runtime even when torch is available.
    models_dir : str or os.PathLike, optional
        Folder of the manifest and templates (ONNX path only); default the
        installed artifacts.
    device : str
        Torch device (torch path only).
    threads : int, optional
        Intra-op threads (default: the runtime's choice).

    Returns
    -------
    EvalResult
        ``accuracy`` in [0, 1], ``loss`` (mean cross-entropy, computed in
        float64 from the logits on both paths) and ``n``.

    Raises
    ------
    ValueError
        On an unknown architecture (or no template for it), weights that do
        not match, or bad data.
    """
    bs = check_positive_int(batch_size, "batch_size")
    if force_onnx or not torch_available():
        logits, ya = onnx_logits(architecture, weights, x, y, bs, models_dir, threads)
    else:
        logits, ya = torch_logits(architecture, weights, x, y, bs, device, threads)
    loss, accuracy = _cross_entropy(logits, ya)
    return EvalResult(accuracy=accuracy, loss=loss, n=int(ya.shape[0]))
