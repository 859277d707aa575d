"""The sketch path stage by stage, for one shipped encoder: what each step of Algorithm 1 costs the device.

Stages, in order: creating the ONNX Runtime session (once), encoding one
image (batch 1) and the whole sample set (in the client's batches), the
per-class means, the quantise-and-pack kernel call on each backend (the
Cython kernel and its numpy twin: one call does min-max normalisation,
rounding, flips with probability P and packing) and the whole
:meth:`~edge_sdk.Sketcher.sketch`. Each figure is the median over the
repeats of :func:`~edge_sdk.bench.timing.measure`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import numpy as np

from .. import bits
from ..encoder import OnnxEncoder
from ..sketch import Sketch, Sketcher
from .results import StageTiming
from .timing import measure, median

__all__ = ["KERNELS", "bench_encoder", "kernel_row"]

#: The bit-kernel backends timed, in this order.
KERNELS = ("cython", "numpy")

Progress = Callable[[str], None]


class _Latents:
    """An encoder that hands back encodings made beforehand, to time the class means alone."""

    def __init__(self, z: np.ndarray) -> None:
        self._z = z

    @property
    def latent_dim(self) -> int:
        return int(self._z.shape[1])

    def encode(self, x: Any) -> np.ndarray:
        return self._z


def _row(encoder: str, stage: str, label: str, times: list[float], samples: int, note: str = "") -> StageTiming:
    return StageTiming(encoder=encoder, stage=stage, label=label, seconds=median(times), best=min(times),
                       samples=int(samples), repeats=len(times), note=note)


def _kernel_note(backend: str) -> Optional[str]:
    """None when ``backend`` cannot run here, else what to know about it."""
    if backend not in bits.available_backends():
        return None
    if backend == bits.BACKEND:
        return "in use"
    if backend == "cython" and os.environ.get("FEDSKETCH_PURE_NUMPY", "") not in ("", "0"):
        return "compiled, not in use (FEDSKETCH_PURE_NUMPY=1)"
    return "not in use"


def kernel_row(encoder: str, backend: str, vectors: np.ndarray, flip_prob: float, seed: int,
               repeats: int) -> StageTiming:
    """The quantise-and-pack kernel call of ``backend`` on ready class vectors ("not compiled" when absent)."""
    classes, latent = vectors.shape
    label = f"quantise + pack, {backend} kernel ({classes}x{latent} bits)"
    note = _kernel_note(backend)
    if note is None:
        return StageTiming(encoder=encoder, stage=f"quantise_pack_{backend}", label=label, seconds=None,
                           best=None, samples=classes, repeats=0,
                           note="not compiled (no C compiler when installed: the numpy twin runs)")
    times = measure(lambda: bits.quantize_pack(vectors, flip_prob, seed, backend=backend), repeats)
    return _row(encoder, f"quantise_pack_{backend}", label, times, classes, note)


def bench_encoder(name: str, x: np.ndarray, y: np.ndarray, *, repeats: int, classes: int, flip_prob: float,
                  batch_size: int, threads: Optional[int], seed: int,
                  progress: Progress = lambda line: None) -> tuple[list[StageTiming], Sketch]:
    """Time every stage of the sketch path of encoder ``name`` on ``x``, ``y``; also return the sketch.

    Parameters
    ----------
    name : str
        A shipped encoder (:func:`edge_sdk.models.artifacts.load_manifest`, role ``encoder``).
    x, y : numpy.ndarray
        Samples of the encoder's input shape (float32 in [0, 1]) and integer labels.
    repeats : int
        Repeats each median is taken over.
    classes, flip_prob, seed
        The :class:`~edge_sdk.Sketcher`'s settings.
    batch_size : int
        Samples per ONNX Runtime call (the client's default is 256).
    threads : int, optional
        ONNX Runtime intra-op threads (None: its default).
    progress : callable
        Called with one line before each stage.
    """
    n = len(x)
    progress(f"{name}: loading the encoder (ONNX Runtime session)")
    t0 = time.perf_counter()
    enc = OnnxEncoder(name, batch_size=batch_size, threads=threads)
    load = time.perf_counter() - t0
    rows = [StageTiming(encoder=name, stage="load", label="load the encoder (ONNX Runtime session, once)",
                        seconds=load, best=load, samples=0, repeats=1)]
    progress(f"{name}: encoding 1 image (batch 1)")
    one = x[:1]
    rows.append(_row(name, "encode_one", "encode 1 image (batch 1)", measure(lambda: enc.encode(one), repeats), 1))
    progress(f"{name}: encoding {n} images")
    rows.append(_row(name, "encode_batch", f"encode {n} images (batches of {min(batch_size, n)})",
                     measure(lambda: enc.encode(x), repeats), n))
    means = Sketcher(_Latents(enc.encode(x)), classes, flip_prob, seed=seed)
    progress(f"{name}: class means")
    rows.append(_row(name, "class_means", f"class means ({classes} classes, encodings ready)",
                     measure(lambda: means.class_means(x, y), repeats), n))
    vectors, _ = means.class_means(x, y)
    for backend in KERNELS:
        progress(f"{name}: quantise + pack, {backend} kernel")
        rows.append(kernel_row(name, backend, vectors, flip_prob, seed, repeats))
    sketcher = Sketcher(enc, classes, flip_prob, seed=seed)
    progress(f"{name}: whole sketch of {n} images")
    rows.append(_row(name, "sketch", f"whole sketch of {n} images (Sketcher.sketch, {bits.BACKEND} kernel)",
                     measure(lambda: sketcher.sketch(x, y), repeats), n))
    return rows, sketcher.sketch(x, y)
