"""Label new samples with exported FedCRef community autoencoders, ONNX Runtime alone (no torch).

The server exports the community models (:func:`server_kit.fedcref.export_communities`);
:class:`OnnxCommunityLabeler` gives each sample the community whose
autoencoder reconstructs it best, the rule of FedCRef's refinement.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..validation import check_int
from .models import as_inputs

__all__ = ["OnnxCommunityLabeler"]


class OnnxCommunityLabeler:
    """Label new samples with exported community autoencoders, ONNX Runtime only.

    Each sample goes to the community whose autoencoder reconstructs it with
    the lowest mean squared error (the rule of FedCRef's refinement).

    Parameters
    ----------
    models : sequence of path, or a folder
        The community ``.onnx`` files (input ``x`` ``(batch, d)``, output
        the reconstruction), in community order; or the folder written by
        :func:`server_kit.fedcref.export_communities`, whose
        ``communities.json`` lists them (their sha256 is checked).
    batch_size : int
        Samples per ONNX Runtime call.
    threads : int, optional
        Intra-op threads of each session.

    Attributes
    ----------
    communities : list of int
        Community id of each model, in column order of :meth:`errors`.
    """

    def __init__(self, models: Any, *, batch_size: int = 1024, threads: Optional[int] = None) -> None:
        import json

        import onnxruntime as ort

        from ..models.artifacts import sha256_file

        self.batch_size = check_int(batch_size, "batch_size")
        paths: list[Path]
        if isinstance(models, (str, os.PathLike)) and Path(models).is_dir():
            folder = Path(models)
            index = json.loads((folder / "communities.json").read_text())
            paths, self.communities = [], []
            for entry in index["communities"]:
                path = folder / entry["file"]
                if sha256_file(path) != entry["sha256"]:
                    raise ValueError(f"{path} does not match the sha256 recorded in communities.json")
                paths.append(path)
                self.communities.append(int(entry["community"]))
        else:
            paths = [Path(p) for p in models]
            self.communities = list(range(len(paths)))
        if not paths:
            raise ValueError("no community models to label with")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads is not None:
            opts.intra_op_num_threads = check_int(threads, "threads")
            opts.inter_op_num_threads = 1
        self._sessions = [ort.InferenceSession(str(p), sess_options=opts, providers=["CPUExecutionProvider"])
                          for p in paths]
        dims = {s.get_inputs()[0].shape[-1] for s in self._sessions}
        if len(dims) != 1 or not isinstance(next(iter(dims)), int):
            raise ValueError(f"community models disagree on their input size: {sorted(map(str, dims))}")
        self.n_features = int(next(iter(dims)))

    def errors(self, x: Any) -> np.ndarray:
        """Per-sample mean squared reconstruction error of every model, ``(n, n_models)`` float64."""
        xa = as_inputs(x, self.n_features)
        if not np.isfinite(xa).all():
            raise ValueError("x contains NaN or Inf")
        out = np.empty((xa.shape[0], len(self._sessions)), dtype=np.float64)
        for j, sess in enumerate(self._sessions):
            name = sess.get_inputs()[0].name
            for start in range(0, xa.shape[0], self.batch_size):
                xb = xa[start : start + self.batch_size]
                rec = sess.run(None, {name: xb})[0].reshape(xb.shape[0], -1)
                out[start : start + xb.shape[0], j] = np.mean((rec.astype(np.float64) - xb) ** 2, axis=1)
        return out

    def predict(self, x: Any) -> np.ndarray:
        """Community id of each sample (lowest reconstruction error)."""
        return np.asarray(self.communities, dtype=np.int64)[np.argmin(self.errors(x), axis=1)]
