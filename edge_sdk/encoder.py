"""ONNX Runtime encoder sessions, checked against the model manifest.

An :class:`OnnxEncoder` is what a device runs to turn its samples into
latent vectors: no torch, only ONNX Runtime. The model file's sha256, input
name, shape and dtype are checked against its manifest entry when the session
opens, and every batch handed to :meth:`OnnxEncoder.encode` is checked against
them too, so a wrong input fails with a message instead of a wrong sketch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .models.artifacts import (
    ArtifactHashError,
    ArtifactSpec,
    artifact_path,
    load_manifest,
    sha256_file,
)

__all__ = ["OnnxEncoder", "check_model_input"]

log = logging.getLogger(__name__)

_ORT_FLOAT = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16"}


def check_model_input(x: Any, spec: ArtifactSpec, what: str = "x") -> np.ndarray:
    """Validate a batch for a model and return it as contiguous ``(n, *input_shape)``.

    Accepts the manifest's per-sample ``input_shape`` or, when the manifest
    gives one, its ``image_shape`` (flattened for the model). Raises
    ``ValueError`` naming what was wrong and what was expected.
    """
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        hint = " (scale uint8 images to [0, 1], for example x / 255.0)" if arr.dtype == np.uint8 else ""
        raise ValueError(
            f"{what} must be a floating-point array for model {spec.name!r}, got dtype {arr.dtype}{hint}"
        )
    sample_shapes = [spec.input_shape]
    if spec.image_shape and np.prod(spec.image_shape) == np.prod(spec.input_shape):
        sample_shapes.append(spec.image_shape)
    if arr.ndim < 1 or tuple(arr.shape[1:]) not in sample_shapes:
        expected = " or ".join(f"(n, {', '.join(map(str, s))})" for s in sample_shapes)
        raise ValueError(f"{what} has shape {arr.shape}; model {spec.name!r} expects {expected}")
    if arr.size and not np.isfinite(arr).all():
        raise ValueError(f"{what} contains NaN or Inf; model {spec.name!r} expects finite values")
    if spec.input_range is not None and arr.size:
        lo, hi = spec.input_range
        amin, amax = float(arr.min()), float(arr.max())
        if amin < lo - 1e-6 or amax > hi + 1e-6:
            raise ValueError(
                f"{what} values span [{amin:g}, {amax:g}]; model {spec.name!r} expects [{lo:g}, {hi:g}]"
            )
    arr = arr.reshape((arr.shape[0],) + spec.input_shape)
    return np.ascontiguousarray(arr, dtype=np.dtype(spec.input_dtype))


class OnnxEncoder:
    """An ONNX Runtime session for an encoder listed in a model manifest.

    Parameters
    ----------
    model : str or path
        An artifact name from the manifest (for example ``"digits_encoder"``)
        or the path of an ``.onnx`` file whose folder holds a manifest that
        lists it.
    models_dir : path, optional
        The folder holding the manifest, for artifact names; default: the
        installed artifacts (see :func:`edge_sdk.models.artifacts.models_dir`).
    batch_size : int
        Samples per ONNX Runtime call.
    threads : int, optional
        Intra-op threads (default: ONNX Runtime's choice). A Raspberry Pi
        shared with training may want 1 or 2.
    providers : sequence of str, optional
        Execution providers; default ``["CPUExecutionProvider"]``.
    verify : bool
        Check the file's sha256 against the manifest (default True).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "digits_encoder",
        *,
        models_dir: str | os.PathLike[str] | None = None,
        batch_size: int = 256,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        verify: bool = True,
    ) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.batch_size = int(batch_size)
        self.path, self.spec = self._resolve(model, models_dir, verify)
        import onnxruntime as ort  # imported here: `import edge_sdk` stays light

        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = int(threads)
            opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._session = ort.InferenceSession(
            str(self.path), sess_options=opts, providers=list(providers or ["CPUExecutionProvider"])
        )
        self._check_session()
        log.info(
            "encoder %s loaded from %s: input %s %s -> latent %s",
            self.spec.name,
            self.path,
            self.spec.input_dtype,
            self.spec.input_shape,
            self.latent_dim,
        )

    @staticmethod
    def _resolve(model, models_dir, verify) -> tuple[Path, ArtifactSpec]:
        p = Path(model)
        if p.suffix == ".onnx" or p.is_file():
            if not p.is_file():
                raise FileNotFoundError(f"model file {p} does not exist")
            manifest = load_manifest(p.parent)
            matches = [s for s in manifest.values() if s.file == p.name]
            if not matches:
                raise ValueError(f"{p.parent}/manifest.json has no entry for {p.name}")
            spec = matches[0]
            if verify and sha256_file(p) != spec.sha256:
                raise ArtifactHashError(
                    f"model {p} has sha256 {sha256_file(p)}, but the manifest expects {spec.sha256}"
                )
            return p, spec
        return artifact_path(str(model), models_dir, verify=verify)

    def _check_session(self) -> None:
        inputs = self._session.get_inputs()
        if len(inputs) != 1:
            raise ValueError(f"model {self.spec.name!r} has {len(inputs)} inputs; an encoder has one")
        inp = inputs[0]
        if inp.name != self.spec.input_name:
            raise ValueError(
                f"model {self.spec.name!r} input is named {inp.name!r}, manifest says {self.spec.input_name!r}"
            )
        dtype = _ORT_FLOAT.get(inp.type)
        if dtype != self.spec.input_dtype:
            raise ValueError(
                f"model {self.spec.name!r} input type is {inp.type}, manifest says {self.spec.input_dtype}"
            )
        static = tuple(d if isinstance(d, int) else None for d in inp.shape[1:])
        if len(static) != len(self.spec.input_shape) or any(
            d is not None and d != e for d, e in zip(static, self.spec.input_shape)
        ):
            raise ValueError(
                f"model {self.spec.name!r} input shape is {inp.shape}, manifest says "
                f"(batch, {', '.join(map(str, self.spec.input_shape))})"
            )
        out = self._session.get_outputs()[0]
        self._output = out.name
        dim = out.shape[-1] if isinstance(out.shape[-1], int) else None
        if self.spec.latent_dim is not None and dim is not None and dim != self.spec.latent_dim:
            raise ValueError(
                f"model {self.spec.name!r} outputs {dim} values, manifest says latent_dim {self.spec.latent_dim}"
            )
        self._latent = self.spec.latent_dim if self.spec.latent_dim is not None else dim

    @property
    def latent_dim(self) -> int:
        """Length of one encoding."""
        if self._latent is None:
            raise ValueError(f"model {self.spec.name!r} declares no latent size")
        return int(self._latent)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample input shape the model takes."""
        return self.spec.input_shape

    def encode(self, x: Any) -> np.ndarray:
        """Encode samples ``(n, *input_shape)`` in batches; returns float32 ``(n, latent)``."""
        arr = check_model_input(x, self.spec)
        n = arr.shape[0]
        out = np.empty((n, self.latent_dim), dtype=np.float32)
        name = self.spec.input_name
        for start in range(0, n, self.batch_size):
            chunk = arr[start : start + self.batch_size]
            z = self._session.run([self._output], {name: chunk})[0]
            out[start : start + len(chunk)] = np.asarray(z, dtype=np.float32).reshape(len(chunk), -1)
        return out

    __call__ = encode

    def __repr__(self) -> str:
        return (
            f"OnnxEncoder({self.spec.name!r}, input={self.spec.input_shape}, "
            f"latent={self._latent}, batch_size={self.batch_size})"
        )
