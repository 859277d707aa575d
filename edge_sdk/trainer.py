"""Local training and evaluation of a classifier on a device.

Weights cross this module as plain ``{name: numpy array}`` dicts, the
``state_dict`` of the architecture (buffers included), which is also what
travels on the wire. Three operations:

* :func:`train_local` trains a copy of the received weights on local data
  with torch and returns the new weights (:class:`TrainResult`).
* :func:`evaluate` measures accuracy and cross-entropy. With torch it runs
  the torch model; without torch (a device that only sketches and
  evaluates) it runs the architecture's shipped ONNX classifier template
  with ONNX Runtime, its initializers replaced by the received weights
  through :meth:`onnxruntime.SessionOptions.add_initializer`. The manifest
  entry's ``initializer_names`` maps each ``state_dict`` key to the ONNX
  initializer that holds it (the export recipe checks it is stored
  unchanged). The session runs at ``ORT_ENABLE_EXTENDED``: at
  ``ORT_ENABLE_ALL`` the NCHWc layout transformer bakes the file's own
  convolution filters in and the overrides of those are ignored. Both paths
  give the same accuracy and losses within about 1e-6.
* :func:`initial_weights` (torch) and :func:`state_spec` (numpy only) give
  the seeded starting weights and the names, shapes and dtypes a received
  update must have.
* :func:`train_autoencoder_local` trains received autoencoder weights on
  local images with the MSE reconstruction loss (federated pre-training of
  the sketch encoder, see :mod:`server_kit.pretrain`).

torch is imported lazily inside the functions that need it: importing this
module (and :mod:`edge_sdk`) never imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ._validation import check_positive_int
from .artifacts import ArtifactSpec, artifact_path, load_manifest, sha256_file
from .artifacts import models_dir as default_models_dir
from .encoder import check_model_input

__all__ = [
    "OPTIMIZERS",
    "EvalResult",
    "TrainResult",
    "evaluate",
    "initial_weights",
    "state_spec",
    "torch_available",
    "train_autoencoder_local",
    "train_local",
]

log = logging.getLogger(__name__)

#: Names accepted by ``train_local(optimizer=...)``.
OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train_local` and :func:`train_autoencoder_local` return.

    Attributes
    ----------
    weights : dict of str to numpy.ndarray
        The trained ``state_dict`` (buffers included): floating tensors as
        float32, integer buffers in their own dtype.
    n_samples : int
        Number of local training samples (the FedAvg weight).
    loss : float
        Mean cross-entropy over the samples of the last epoch, measured
        while training (for :func:`train_autoencoder_local`: the mean
        squared reconstruction error per element).
    seconds : float
        Wall-clock time of the training loop.
    """

    weights: dict[str, np.ndarray]
    n_samples: int
    loss: float
    seconds: float


@dataclass(frozen=True)
class EvalResult:
    """What :func:`evaluate` returns: accuracy in [0, 1], mean cross-entropy, sample count."""

    accuracy: float
    loss: float
    n: int


@dataclass(frozen=True)
class _ModelInfo:
    """What validation needs to know of an architecture."""

    architecture: str
    input_shape: tuple[int, ...]
    num_classes: int
    spec: dict[str, tuple[tuple[int, ...], str]]


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=1)
def torch_available() -> bool:
    """Whether torch can be imported here (checked without importing it).

    Returns
    -------
    bool
        True when an installed ``torch`` package is found.
    """
    return importlib.util.find_spec("torch") is not None


def _import_torch() -> Any:
    """Import torch, or fail with a message that says what works without it."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the test environment has torch
        raise ImportError(
            "local training needs torch (pip install 'fedsketch[train]' or a torch wheel "
            "for this platform); evaluate() and sketching work without it"
        ) from e
    return torch


def state_spec(weights: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of a weights dict, for validating what arrives.

    Parameters
    ----------
    weights : mapping of str to array-like
        A ``state_dict`` as numpy arrays.

    Returns
    -------
    dict
        ``{name: (shape, dtype name)}``, for example
        ``{"conv1.weight": ((16, 1, 3, 3), "float32"), ...}``, in the order of
        ``weights``.
    """
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, value in weights.items():
        a = np.asarray(value)
        out[str(name)] = (tuple(int(d) for d in a.shape), a.dtype.name)
    return out


def _check_lr(lr: Any) -> None:
    if (
        isinstance(lr, bool)
        or not isinstance(lr, (int, float, np.integer, np.floating))
        or not (math.isfinite(lr) and lr > 0)
    ):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")


def _check_seed(seed: Any) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")

def _check_weights(info: _ModelInfo, weights: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Check names, shapes, dtypes and finiteness against the architecture; return arrays."""
    if not isinstance(weights, Mapping):
        raise ValueError(
            f"weights must be a mapping of tensor names to arrays, got {type(weights).__name__}"
        )
    missing = [k for k in info.spec if k not in weights]
    unexpected = sorted(str(k) for k in weights if k not in info.spec)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        raise ValueError(
            f"weights do not match architecture {info.architecture!r}: {'; '.join(parts)}"
        )
    out: dict[str, np.ndarray] = {}
    for name, (shape, dtype) in info.spec.items():
        a = np.asarray(weights[name])
        if a.shape != shape:
            raise ValueError(
                f"weights[{name!r}] has shape {a.shape}; architecture {info.architecture!r} "
                f"expects {shape}"
            )
        want = np.dtype(dtype)
        if np.issubdtype(want, np.floating):
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(
                    f"weights[{name!r}] has dtype {a.dtype}; expected a floating-point array"
                )
            if not np.isfinite(a).all():
                raise ValueError(f"weights[{name!r}] contains NaN or Inf")
        elif not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"weights[{name!r}] has dtype {a.dtype}; expected integers ({want})")
        arr = np.asarray(a, dtype=want, order="C")  # (ascontiguousarray would make 0-d 1-d)
        # torch.from_numpy warns on read-only arrays (as decoded from a payload): copy those
        out[name] = arr if arr.flags.writeable else arr.copy()
    return out


def _check_data(info: _ModelInfo, x: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate samples and labels; return float32 ``(n, *input_shape)`` and int64 ``(n,)``."""
    shape = info.input_shape
    spec = ArtifactSpec(
        name=info.architecture,
        file="",
        sha256="",
        role="classifier",
        input_shape=shape,
        # a single-channel model also takes (n, H, W) images
        image_shape=shape[1:] if len(shape) > 1 and shape[0] == 1 else None,
        input_range=(0.0, 1.0),
    )
    xa = check_model_input(x, spec, "x")
    if not xa.flags.writeable:  # see _check_weights
        xa = xa.copy()
    if xa.shape[0] == 0:
        raise ValueError("x holds no samples")
    ya = np.asarray(y)
    if ya.ndim != 1 or ya.shape[0] != xa.shape[0]:
        raise ValueError(
            f"y has shape {ya.shape}; expected ({xa.shape[0]},), one label per sample of x"
        )
    if not np.issubdtype(ya.dtype, np.integer):
        raise ValueError(f"y must hold integer class labels, got dtype {ya.dtype}")
    lo, hi = int(ya.min()), int(ya.max())
    if lo < 0 or hi >= info.num_classes:
        raise ValueError(
            f"labels must lie in [0, {info.num_classes - 1}] for {info.architecture!r}, "
            f"got values in [{lo}, {hi}]"
        )
    return xa, ya.astype(np.int64)


def _cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean cross-entropy (float64, log-sum-exp) and accuracy of ``logits`` for labels ``y``."""
    z = np.asarray(logits, dtype=np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=1)) + m[:, 0]
    loss = float(np.mean(lse - z[np.arange(len(y)), y]))
    accuracy = float(np.mean(np.argmax(z, axis=1) == y))
    return loss, accuracy


# --------------------------------------------------------------------------- torch side


@contextlib.contextmanager
def _torch_threads(torch: Any, threads: int | None) -> Iterator[None]:
    """Use ``threads`` intra-op threads inside the block (unchanged when None).

    On a CPU without LSE atomics (Raspberry Pi 4) always one thread: torch's
    aarch64 build dies with SIGILL on more (see :mod:`edge_sdk.cpu`).
    """
    from .cpu import torch_threads

    if threads is not None:
        check_positive_int(threads, "threads")
    threads = torch_threads(threads)
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(check_positive_int(threads, "threads"))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build(architecture: str) -> tuple[Any, _ModelInfo]:
    """A fresh torch classifier (the caller's torch RNG left untouched) and its info."""
    torch = _import_torch()
    from .nets import ARCHITECTURES, build_model

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    with torch.random.fork_rng(devices=[]):
        model = build_model(architecture)
    if not hasattr(model, "num_classes") or not hasattr(model, "input_shape"):
        raise ValueError(
            f"architecture {architecture!r} is not a classifier (no num_classes and input_shape)"
        )
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    info = _ModelInfo(
        architecture=architecture,
        input_shape=tuple(int(d) for d in model.input_shape),
        num_classes=int(model.num_classes),
        spec=state_spec(state),
    )
    return model, info


def _to_numpy_state(model: Any) -> dict[str, np.ndarray]:
    """``state_dict`` as fresh numpy arrays: floats as float32, integer buffers unchanged."""
    out = {}
    for k, v in model.state_dict().items():
        a = v.detach().cpu().numpy()
        out[k] = a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) else a.copy()
    return out


def initial_weights(architecture: str, seed: int) -> dict[str, np.ndarray]:
    """Seeded initial weights of an architecture (needs torch).

    ``torch.manual_seed(seed)`` then the constructor, which is what the
    export recipe does: ``initial_weights("digits_cnn_1x8x8_10", 0)`` equals
    the shipped ``digits_cnn.safetensors``. The caller's torch RNG state is
    restored afterwards.

    Parameters
    ----------
    architecture : str
        A key of :data:`edge_sdk.nets.ARCHITECTURES`.
    seed : int
        Seed of the initialisation.

    Returns
    -------
    dict of str to numpy.ndarray
        The ``state_dict`` (float32 floats, integer buffers as they are).
    """
    torch = _import_torch()
    from .nets import ARCHITECTURES, build_model

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = build_model(architecture)
    return _to_numpy_state(model)


def _optimizer(torch: Any, name: str, params: Any, lr: float) -> Any:
    factories = {
        "adam": lambda: torch.optim.Adam(params, lr=lr),
        "sgd": lambda: torch.optim.SGD(params, lr=lr),
    }
    return factories[name]()



def _finished(architecture: str, state: dict[str, np.ndarray], n: int, n_epochs: int, last: float,
              lr: float, seconds: float, what: str) -> TrainResult:
    """Refuse a diverged model, log, and wrap the result of a local training run."""
    bad = [k for k, v in state.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all()]
    if bad:
        raise RuntimeError(
            f"training diverged: {bad[0]!r} became NaN or Inf (last epoch loss {last:g}); "
            f"try a smaller lr than {lr:g}"
        )
    items, metric = what.split(", ")
    log.debug("%s: %d %s, %d epochs, %s %.5f, %.2f s", architecture, n, items, n_epochs, metric, last, seconds)
    return TrainResult(weights=state, n_samples=int(n), loss=float(last), seconds=float(seconds))

def train_local(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    optimizer: str = "adam",
    seed: Optional[int] = None,
    device: str = "cpu",
    threads: Optional[int] = None,
) -> TrainResult:
    """Train received weights on local data with cross-entropy; return the new weights.

    Parameters
    ----------
    architecture : str
        A classifier key of :data:`edge_sdk.nets.ARCHITECTURES`
        (``"digits_cnn_1x8x8_10"``, ``"lenet5_1x28x28_10"``).
    weights : mapping of str to numpy.ndarray
        The starting ``state_dict``; names and shapes must be exactly those
        of the architecture, floating tensors finite. Not modified.
    x : numpy.ndarray
        Samples, floating point in [0, 1], shaped ``(n, *input_shape)``
        (``(n, 1, 8, 8)``); single-channel images may omit the channel axis
        (``(n, 8, 8)``).
    y : numpy.ndarray
        Integer labels ``(n,)`` in ``[0, num_classes)``.
    epochs : int
        Passes over the data, each with a fresh shuffle.
    lr : float
        Learning rate.
    batch_size : int
        Mini-batch size (the last batch of an epoch may be smaller).
    optimizer : {"adam", "sgd"}
        Optimiser, created fresh (no state carried between calls).
    seed : int, optional
        Seeds the shuffling generator and torch's global RNG inside the call
        (the caller's RNG state is restored): with the same seed, data,
        weights and thread count the result is bit-identical. None draws a
        seed from the OS.
    device : str
        Torch device, for example ``"cpu"`` or ``"cuda"``.
    threads : int, optional
        Intra-op threads during the call (restored afterwards); default:
        leave torch's setting alone.

    Returns
    -------
    TrainResult
        The trained weights, sample count, last epoch's mean loss, seconds.

    Raises
    ------
    ValueError
        On an unknown architecture, weights that do not match it, data of the
        wrong shape, range or dtype, NaN or Inf, labels out of range, or bad
        hyper-parameters.
    RuntimeError
        If training diverges (the weights become NaN or Inf).
    ImportError
        If torch is not installed.
    """
    n_epochs = check_positive_int(epochs, "epochs")
    bs = check_positive_int(batch_size, "batch_size")
    _check_lr(lr)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {optimizer!r}")
    _check_seed(seed)
    if threads is not None:
        check_positive_int(threads, "threads")
    torch = _import_torch()
    model, info = _build(architecture)
    w = _check_weights(info, weights)
    xa, ya = _check_data(info, x, y)
    dev = torch.device(device)
    n = xa.shape[0]
    t0 = time.perf_counter()
    fork_devices = [dev.index or 0] if dev.type == "cuda" else []
    with _torch_threads(torch, threads), torch.random.fork_rng(devices=fork_devices):
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            torch.manual_seed(int(seed))
            gen.manual_seed(int(seed))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
        model.to(dev).train()
        opt = _optimizer(torch, optimizer, model.parameters(), float(lr))
        xt = torch.from_numpy(xa).to(dev)
        yt = torch.from_numpy(ya).to(dev)
        loss_fn = torch.nn.CrossEntropyLoss()
        last = math.nan
        for _ in range(n_epochs):
            perm = torch.randperm(n, generator=gen).to(dev)
            total = torch.zeros((), dtype=torch.float64, device=dev)
            for start in range(0, n, bs):
                idx = perm[start : start + bs]
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(xt[idx]), yt[idx])
                loss.backward()
                opt.step()
                total += loss.detach().double() * idx.shape[0]
            last = float(total) / n
        model.eval()
        out = _to_numpy_state(model)
    return _finished(architecture, out, n, n_epochs, last, lr, time.perf_counter() - t0, "samples, loss")


# --------------------------------------------------------------------------- autoencoders


def _build_autoencoder(architecture: str) -> tuple[Any, _ModelInfo, Optional[tuple[int, ...]]]:
    """A fresh torch autoencoder (caller's torch RNG untouched), its info and its image shape.

    The info's ``num_classes`` is 0 (unused: there are no labels). The image
    shape is the square ``(side, side)`` a flattened FC input may also be
    given as, or None.
    """
    torch = _import_torch()
    from .nets import ARCHITECTURES, build_model

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    with torch.random.fork_rng(devices=[]):
        model = build_model(architecture)
    if not callable(getattr(model, "encode", None)) or not hasattr(model, "decoder"):
        raise ValueError(
            f"architecture {architecture!r} is not an autoencoder (no encode() and decoder)"
        )
    image_shape: Optional[tuple[int, ...]] = None
    if hasattr(model, "in_features"):  # FCAutoencoder: flattened images
        input_shape: tuple[int, ...] = (int(model.in_features),)
        side = math.isqrt(int(model.in_features))
        if side * side == int(model.in_features):
            image_shape = (side, side)
    elif hasattr(model, "channels"):  # ConvAutoencoder: (C, 32, 32) NCHW
        input_shape = (int(model.channels[0]), 32, 32)
    else:  # pragma: no cover - every registered autoencoder is one of the two
        raise ValueError(f"architecture {architecture!r}: unknown autoencoder input shape")
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    info = _ModelInfo(
        architecture=architecture, input_shape=input_shape, num_classes=0, spec=state_spec(state)
    )
    return model, info, image_shape


def train_autoencoder_local(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: np.ndarray,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: Optional[int] = None,
    threads: Optional[int] = None,
) -> TrainResult:
    """Train received autoencoder weights to reconstruct local images (MSE, Adam).

    The local step of federated autoencoder pre-training (the paper's
    Section V): the same loop as :func:`train_local`, with the mean squared
    reconstruction error per element as the loss and a fresh Adam optimiser.

    Parameters
    ----------
    architecture : str
        An autoencoder key of :data:`edge_sdk.nets.ARCHITECTURES`
        (``"fc_ae_784_50_20"``, ``"fc_ae_64_48_20"``, ``"conv_ae_3_12_24_48"``).
    weights : mapping of str to numpy.ndarray
        The starting ``state_dict`` (buffers included); names and shapes must
        be exactly those of the architecture, floating tensors finite. Not
        modified.
    x : numpy.ndarray
        Images, floating point in [0, 1]: ``(n, in_features)`` for a fully
        connected autoencoder, or square images ``(n, side, side)``
        (``(n, 28, 28)`` or ``(n, 784)`` for ``fc_ae_784_50_20``);
        ``(n, 3, 32, 32)`` for the convolutional one.
    epochs : int
        Passes over the data, each with a fresh shuffle.
    lr : float
        Adam learning rate.
    batch_size : int
        Mini-batch size (the last batch of an epoch may be smaller).
    seed : int, optional
        Seeds the shuffling generator and torch's global RNG inside the call
        (the caller's RNG state is restored): with the same seed, data,
        weights and thread count the result is bit-identical. None draws a
        seed from the OS.
    threads : int, optional
        Intra-op threads during the call (restored afterwards).

    Returns
    -------
    TrainResult
        The trained weights (float32, integer buffers unchanged), the sample
        count, the last epoch's mean reconstruction MSE per element (in
        ``loss``) and the seconds spent.

    Raises
    ------
    ValueError
        On an unknown or non-autoencoder architecture, weights that do not
        match it, images of the wrong shape, dtype or range, NaN or Inf, no
        images, or bad hyper-parameters.
    RuntimeError
        If training diverges (the weights become NaN or Inf).
    ImportError
        If torch is not installed.
    """
    n_epochs = check_positive_int(epochs, "epochs")
    bs = check_positive_int(batch_size, "batch_size")
    _check_lr(lr)
    _check_seed(seed)
    if threads is not None:
        check_positive_int(threads, "threads")
    torch = _import_torch()
    model, info, image_shape = _build_autoencoder(architecture)
    w = _check_weights(info, weights)
    spec = ArtifactSpec(
        name=architecture,
        file="",
        sha256="",
        role="autoencoder",
        input_shape=info.input_shape,
        image_shape=image_shape,
        input_range=(0.0, 1.0),
    )
    xa = check_model_input(x, spec, "x")
    if not xa.flags.writeable:  # see _check_weights
        xa = xa.copy()
    n = xa.shape[0]
    if n == 0:
        raise ValueError("x holds no samples")
    t0 = time.perf_counter()
    with _torch_threads(torch, threads), torch.random.fork_rng(devices=[]):
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            torch.manual_seed(int(seed))
            gen.manual_seed(int(seed))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=float(lr))
        xt = torch.from_numpy(xa)
        flat = xt.reshape(n, -1)
        loss_fn = torch.nn.MSELoss()
        last = math.nan
        for _ in range(n_epochs):
            perm = torch.randperm(n, generator=gen)
            total = torch.zeros((), dtype=torch.float64)
            for start in range(0, n, bs):
                idx = perm[start : start + bs]
                opt.zero_grad(set_to_none=True)
                # the FC autoencoder returns flattened reconstructions, the conv one images
                out = model(xt[idx])
                loss = loss_fn(out.reshape(idx.shape[0], -1), flat[idx])
                loss.backward()
                opt.step()
                total += loss.detach().double() * idx.shape[0]
            last = float(total) / n
        model.eval()
        out_state = _to_numpy_state(model)
    return _finished(architecture, out_state, n, n_epochs, last, lr, time.perf_counter() - t0, "images, MSE")


def _torch_logits(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: Any,
    y: Any,
    batch_size: int,
    device: str,
    threads: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    torch = _import_torch()
    model, info = _build(architecture)
    w = _check_weights(info, weights)
    xa, ya = _check_data(info, x, y)
    dev = torch.device(device)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
    model.to(dev).eval()
    chunks = []
    with _torch_threads(torch, threads), torch.no_grad():
        for start in range(0, xa.shape[0], batch_size):
            xb = torch.from_numpy(xa[start : start + batch_size]).to(dev)
            chunks.append(model(xb).float().cpu().numpy())
    return np.concatenate(chunks), ya


# --------------------------------------------------------------------------- ONNX Runtime side


@dataclass(frozen=True)
class _OnnxTemplate:
    path: Path
    info: _ModelInfo
    initializers: dict[str, str]
    input_name: str
    output_name: str


@functools.lru_cache(maxsize=16)
def _onnx_template_cached(directory: str, architecture: str, stamp: int) -> _OnnxTemplate:
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
    info = _ModelInfo(
        architecture=architecture,
        input_shape=spec.input_shape,
        num_classes=spec.num_classes,
        spec=dict(template_spec),
    )
    return _OnnxTemplate(path, info, dict(names), spec.input_name, spec.output_name)


def _onnx_template(architecture: str, models_dir: str | os.PathLike[str] | None) -> _OnnxTemplate:
    d = Path(models_dir) if models_dir is not None else default_models_dir()
    stamp = (d / "manifest.json").stat().st_mtime_ns
    return _onnx_template_cached(str(d.resolve()), architecture, stamp)


def _onnx_logits(
    architecture: str,
    weights: Mapping[str, np.ndarray],
    x: Any,
    y: Any,
    batch_size: int,
    models_dir: str | os.PathLike[str] | None,
    threads: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    import onnxruntime as ort

    tpl = _onnx_template(architecture, models_dir)
    w = _check_weights(tpl.info, weights)
    xa, ya = _check_data(tpl.info, x, y)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # Not ORT_ENABLE_ALL: its NCHWc layout transformer reorders convolution
    # filters from the model file's own initializers, so overrides of
    # convolution weights were silently ignored (onnxruntime 1.31.1).
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    if threads is not None:
        opts.intra_op_num_threads = check_positive_int(threads, "threads")
        opts.inter_op_num_threads = 1
    # The OrtValues wrap these arrays without copying: both must outlive the session.
    keep: list[Any] = []
    for key, init_name in tpl.initializers.items():
        arr = np.asarray(w[key], order="C")
        value = ort.OrtValue.ortvalue_from_numpy(arr)
        keep.append((arr, value))
        opts.add_initializer(init_name, value)
    session = ort.InferenceSession(
        str(tpl.path), sess_options=opts, providers=["CPUExecutionProvider"]
    )
    chunks = []
    for start in range(0, xa.shape[0], batch_size):
        chunk = xa[start : start + batch_size]
        chunks.append(np.asarray(session.run([tpl.output_name], {tpl.input_name: chunk})[0]))
    del session
    keep.clear()
    return np.concatenate(chunks).reshape(xa.shape[0], -1), ya


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
        Samples and labels, as for :func:`train_local`.
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
        logits, ya = _onnx_logits(architecture, weights, x, y, bs, models_dir, threads)
    else:
        logits, ya = _torch_logits(architecture, weights, x, y, bs, device, threads)
    loss, accuracy = _cross_entropy(logits, ya)
    return EvalResult(accuracy=accuracy, loss=loss, n=int(ya.shape[0]))
