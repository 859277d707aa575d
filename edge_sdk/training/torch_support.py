"""torch on a device, imported lazily: whether it is there, its threads, fresh nets and their weights.

Importing this module never imports torch; each function that needs it
imports it (:func:`import_torch`), so a device without torch still sketches
and evaluates with ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..install import install_hint
from ..models.model_checks import ModelInfo, state_spec
from ..validation import check_positive_int

__all__ = [
    "DEVICES",
    "build_classifier",
    "import_torch",
    "initial_weights",
    "numpy_state",
    "resolve_device",
    "torch_available",
    "using_threads",
]


@functools.lru_cache(maxsize=1)
def torch_available() -> bool:
    """Whether torch can be imported here (checked without importing it).

    Returns
    -------
    bool
        True when an installed ``torch`` package is found.
    """
    return importlib.util.find_spec("torch") is not None


def import_torch() -> Any:
    """Import torch, or fail with a message that says what works without it.

    Returns
    -------
    module
        The ``torch`` module.

    Raises
    ------
    ImportError
        If torch is not installed.
    """
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the test environment has torch
        raise ImportError(
            f"local training needs torch ({install_hint('train')}, or a torch wheel for this platform); "
            "evaluate() and sketching work without it"
        ) from e
    return torch


#: Values of every ``--device`` option: ``auto`` is ``cuda`` when torch sees a CUDA device, else ``cpu``.
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``--device`` value, checked.

    Raises
    ------
    ValueError
        On a value outside :data:`DEVICES`, or ``"cuda"`` where torch sees no CUDA device.
    """
    from ..validation import check_choice

    check_choice(device, "device", DEVICES)
    torch = import_torch()
    has_cuda = bool(torch.cuda.is_available())
    if device == "cuda" and not has_cuda:
        raise ValueError("device 'cuda' asked but torch sees no CUDA device")
    return "cuda" if device == "cuda" or (device == "auto" and has_cuda) else "cpu"


@contextlib.contextmanager
def using_threads(torch: Any, threads: int | None) -> Iterator[None]:
    """Use ``threads`` intra-op threads inside the block (unchanged when None).

    On a CPU without LSE atomics (Raspberry Pi 4) always one thread: torch's
    aarch64 build dies with SIGILL on more (see :mod:`edge_sdk.cpu`).

    Parameters
    ----------
    torch : module
        The ``torch`` module.
    threads : int, optional
        Intra-op threads inside the block; restored afterwards.
    """
    from ..cpu import torch_threads

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


def build_classifier(architecture: str) -> tuple[Any, ModelInfo]:
    """A fresh torch classifier (the caller's torch RNG left untouched) and its info.

    Parameters
    ----------
    architecture : str
        A classifier key of :data:`edge_sdk.training.nets.ARCHITECTURES`.

    Returns
    -------
    tuple
        The model (random weights) and its :class:`ModelInfo`.

    Raises
    ------
    ValueError
        On an unknown architecture, or one that is not a classifier.
    """
    torch = import_torch()
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
    info = ModelInfo(
        architecture=architecture,
        input_shape=tuple(int(d) for d in model.input_shape),
        num_classes=int(model.num_classes),
        spec=state_spec(state),
    )
    return model, info


def numpy_state(model: Any) -> dict[str, np.ndarray]:
    """``state_dict`` as fresh numpy arrays: floats as float32, integer buffers unchanged.

    Parameters
    ----------
    model : torch.nn.Module
        Any module.

    Returns
    -------
    dict of str to numpy.ndarray
        Copies, in the ``state_dict``'s order.
    """
    out = {}
    for k, v in model.state_dict().items():
        a = v.detach().cpu().numpy()
        out[k] = a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) else a.copy()
    return out


def initial_weights(architecture: str, seed: int) -> dict[str, np.ndarray]:
    """Portable seeded initial weights of an architecture, bit for bit the same on every platform.

    torch builds the model only for its structure (the names, shapes and dtypes of its
    ``state_dict``; the caller's torch RNG state is left untouched); the values are
    :func:`edge_sdk.models.portable_init.initial_tensors` of that spec and ``seed``, which follow
    torch's default initialisation in law but not in value: they are neither what
    ``torch.manual_seed(seed)`` and the constructor give nor the shipped
    ``digits_cnn.safetensors``. Every device (x86 or a Raspberry Pi) builds the same bits,
    so a federation's version 0 never has to be sent.

    Parameters
    ----------
    architecture : str
        A key of :data:`edge_sdk.training.nets.ARCHITECTURES`.
    seed : int
        Seed of the initialisation, in ``[0, 2**64)``.

    Returns
    -------
    dict of str to numpy.ndarray
        The ``state_dict``'s tensors in its order (float32 floats, integer buffers zero).
    """
    torch = import_torch()
    from ..models.portable_init import initial_tensors
    from .nets import ARCHITECTURES, build_model

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    with torch.random.fork_rng(devices=[]):
        model = build_model(architecture)
    return initial_tensors(state_spec(numpy_state(model)), seed)
