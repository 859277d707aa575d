"""Local training of received weights on a device with torch, in one epoch loop.

Weights cross this module as plain ``{name: numpy array}`` dicts, the
``state_dict`` of the architecture (buffers included), which is also what
travels on the wire. The operations:

* :func:`train_local` trains a copy of the received weights on local data
  with torch and returns the new weights (:class:`TrainResult`).
* :func:`train_autoencoder_local` trains received autoencoder weights on
  local images with the MSE reconstruction loss (federated pre-training of
  the sketch encoder, see :mod:`server_kit.pretrain`).

Both run :func:`edge_sdk.training.train_loop.run_epochs`. Re-exported here, from the
modules that own them: :func:`evaluate` and :class:`EvalResult` (accuracy and
cross-entropy with torch or, without torch, ONNX Runtime:
:mod:`edge_sdk.training.evaluation`), :func:`initial_weights` and
:func:`torch_available` (:mod:`edge_sdk.training.torch_support`) and
:func:`state_spec` (the names, shapes and dtypes a received update must
have: :mod:`edge_sdk.models.model_checks`).

torch is imported lazily inside the functions that need it: importing this
module (and :mod:`edge_sdk`) never imports torch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..encoder import check_model_input
from ..models.artifacts import ArtifactSpec
from ..models.model_checks import ModelInfo, check_data, check_weights, state_spec
from ..validation import check_choice, check_positive_int
from .evaluation import EvalResult, evaluate
from .torch_support import (
    build_classifier,
    import_torch,
    initial_weights,
    numpy_state,
    torch_available,
    using_threads,
)
from .train_loop import run_epochs

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


def _check_settings(epochs: Any, batch_size: Any, lr: Any, seed: Any, threads: Any,
                    optimizer: Optional[str] = None) -> tuple[int, int]:
    """Check the hyper-parameters of a local training (in this order); return epochs and batch size."""
    n_epochs = check_positive_int(epochs, "epochs")
    bs = check_positive_int(batch_size, "batch_size")
    _check_lr(lr)
    if optimizer is not None:
        check_choice(optimizer, "optimizer", OPTIMIZERS)
    _check_seed(seed)
    if threads is not None:
        check_positive_int(threads, "threads")
    return n_epochs, bs


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


def _train(torch: Any, model: Any, weights: dict[str, np.ndarray], n: int, *, epochs: int, batch_size: int,
           optimizer: str, lr: float, seed: Optional[int], threads: Optional[int], device: Any,
           batch_loss: Callable[[Any], Any]) -> tuple[dict[str, np.ndarray], float]:
    """Load ``weights`` into ``model``, run the epoch loop, return the trained state and the last epoch's loss.

    Inside, on ``threads``, the shuffling generator and torch's global RNG
    are seeded with ``seed`` (None: the generator from the OS) and the
    caller's RNG state is restored afterwards (a CUDA device's too). The
    optimiser is created fresh.
    """
    fork_devices = [device.index or 0] if device.type == "cuda" else []
    with using_threads(torch, threads), torch.random.fork_rng(devices=fork_devices):
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            torch.manual_seed(int(seed))
            gen.manual_seed(int(seed))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
        model.to(device).train()
        opt = _optimizer(torch, optimizer, model.parameters(), float(lr))
        last = run_epochs(opt, batch_loss, n, epochs=epochs, batch_size=batch_size, generator=gen, device=device)
        model.eval()
        return numpy_state(model), last


def _cross_entropy_loss(torch: Any, model: Any, xa: np.ndarray, ya: np.ndarray, device: Any) -> Callable[[Any], Any]:
    """``batch_loss(idx)`` for the epoch loop: the classifier's mean cross-entropy on the samples at ``idx``."""
    xt, yt = torch.from_numpy(xa).to(device), torch.from_numpy(ya).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    return lambda idx: loss_fn(model(xt[idx]), yt[idx])


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
        A classifier key of :data:`edge_sdk.training.nets.ARCHITECTURES`
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
    n_epochs, bs = _check_settings(epochs, batch_size, lr, seed, threads, optimizer)
    torch = import_torch()
    model, info = build_classifier(architecture)
    w = check_weights(info, weights)
    xa, ya = check_data(info, x, y)
    dev = torch.device(device)
    n = xa.shape[0]
    t0 = time.perf_counter()
    out, last = _train(torch, model, w, n, epochs=n_epochs, batch_size=bs, optimizer=optimizer, lr=lr, seed=seed,
                       threads=threads, device=dev, batch_loss=_cross_entropy_loss(torch, model, xa, ya, dev))
    return _finished(architecture, out, n, n_epochs, last, lr, time.perf_counter() - t0, "samples, loss")


# --------------------------------------------------------------------------- autoencoders


def _build_autoencoder(architecture: str) -> tuple[Any, ModelInfo, Optional[tuple[int, ...]]]:
    """A fresh torch autoencoder (caller's torch RNG untouched), its info and its image shape.

    The info's ``num_classes`` is 0 (unused: there are no labels). The image
    shape is the square ``(side, side)`` a flattened FC input may also be
    given as, or None.
    """
    torch = import_torch()
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
    info = ModelInfo(
        architecture=architecture, input_shape=input_shape, num_classes=0, spec=state_spec(state)
    )
    return model, info, image_shape


def _check_images(info: ModelInfo, image_shape: Optional[tuple[int, ...]], x: Any) -> np.ndarray:
    """Validate an autoencoder's images; return them float32 ``(n, *input_shape)``, writeable."""
    spec = ArtifactSpec(
        name=info.architecture,
        file="",
        sha256="",
        role="autoencoder",
        input_shape=info.input_shape,
        image_shape=image_shape,
        input_range=(0.0, 1.0),
    )
    xa = check_model_input(x, spec, "x")
    if not xa.flags.writeable:  # see edge_sdk.models.model_checks.check_weights
        xa = xa.copy()
    if xa.shape[0] == 0:
        raise ValueError("x holds no samples")
    return xa


def _reconstruction_loss(torch: Any, model: Any, xa: np.ndarray, device: Any) -> Callable[[Any], Any]:
    """``batch_loss(idx)`` for the epoch loop: the mean squared reconstruction error per element at ``idx``."""
    xt = torch.from_numpy(xa).to(device)
    flat = xt.reshape(xa.shape[0], -1)
    loss_fn = torch.nn.MSELoss()

    def batch_loss(idx: Any) -> Any:
        # the FC autoencoder returns flattened reconstructions, the conv one images
        return loss_fn(model(xt[idx]).reshape(idx.shape[0], -1), flat[idx])

    return batch_loss


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
    device: str = "cpu",
) -> TrainResult:
    """Train received autoencoder weights to reconstruct local images (MSE, Adam).

    The local step of federated autoencoder pre-training (the paper's
    Section V): the same loop as :func:`train_local`, with the mean squared
    reconstruction error per element as the loss and a fresh Adam optimiser.

    Parameters
    ----------
    architecture : str
        An autoencoder key of :data:`edge_sdk.training.nets.ARCHITECTURES`
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
    device : str
        Torch device, for example ``"cpu"`` or ``"cuda"``.

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
    n_epochs, bs = _check_settings(epochs, batch_size, lr, seed, threads)
    torch = import_torch()
    model, info, image_shape = _build_autoencoder(architecture)
    w = check_weights(info, weights)
    xa = _check_images(info, image_shape, x)
    n = xa.shape[0]
    dev = torch.device(device)
    t0 = time.perf_counter()
    out_state, last = _train(torch, model, w, n, epochs=n_epochs, batch_size=bs, optimizer="adam", lr=lr, seed=seed,
                             threads=threads, device=dev, batch_loss=_reconstruction_loss(torch, model, xa, dev))
    return _finished(architecture, out_state, n, n_epochs, last, lr, time.perf_counter() - t0, "images, MSE")
