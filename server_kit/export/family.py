"""One model's artifact family: its weights and ONNX files written, verified, and their manifest entries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_sdk.models.artifacts import sha256_file
from server_kit.nets import count_params

from .files import save_weights
from .onnx import OPSET, export_onnx, initializer_names, verify_onnx

__all__ = ["UNIT_RANGE", "export_family"]

UNIT_RANGE = [0.0, 1.0]


def _versions() -> dict[str, str]:
    """Versions of the libraries that produced the artifacts."""
    import onnx
    import onnxruntime
    import safetensors

    out = {
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
    try:
        import onnxscript

        out["onnxscript"] = onnxscript.__version__
    except ImportError:  # pragma: no cover - needed by the dynamo exporter anyway
        pass
    return out



def export_family(
    model: nn.Module,
    *,
    out: Path,
    architecture: str,
    weights_name: str,
    exports: Sequence[Mapping[str, Any]],
    common: Mapping[str, Any],
) -> dict[str, dict[str, Any]]:
    """Write one model's weights and ONNX files, verify them, build their entries.

    Parameters
    ----------
    model : torch.nn.Module
        The (trained or seeded) model, full autoencoder or classifier.
    out : pathlib.Path
        Output folder.
    architecture : str
        Registered architecture name.
    weights_name : str
        Stem of the safetensors file.
    exports : sequence of mapping
        One per ONNX artifact, with keys ``name``, ``module``, ``role``,
        ``output_name``, ``sample_shape`` and optional ``params`` (the
        parameter count to record, default that of ``module``), ``fields``
        (extra manifest fields) and ``map_initializers`` (record
        :func:`initializer_names` as ``initializer_names``).
    common : mapping
        Manifest fields shared by every artifact of the family.

    Returns
    -------
    dict
        Artifact name -> manifest entry.
    """
    model.eval()
    weights_path = out / f"{weights_name}.safetensors"
    save_weights(model, weights_path, architecture)
    weights = {"file": weights_path.name, "sha256": sha256_file(weights_path)}
    entries: dict[str, dict[str, Any]] = {}
    for spec in exports:
        path = out / f"{spec['name']}.onnx"
        module: nn.Module = spec["module"]
        shape = tuple(spec["sample_shape"])
        ir_version = export_onnx(module, path, shape, output_name=spec["output_name"])
        verify_onnx(path, module, shape, output_name=spec["output_name"])
        entry: dict[str, Any] = {
            "file": path.name,
            "sha256": sha256_file(path),
            "role": spec["role"],
            "architecture": architecture,
            "input_name": "x",
            "output_name": spec["output_name"],
            "input_shape": list(shape),
            "input_dtype": "float32",
            "input_range": list(UNIT_RANGE),
            "params": int(spec.get("params", count_params(module))),
            "weights": dict(weights),
            "opset": OPSET,
            "ir_version": ir_version,
            "created_with": _versions(),
        }
        if spec.get("map_initializers"):
            entry["initializer_names"] = initializer_names(path, module)
        entry.update(common)
        entry.update(spec.get("fields", {}))
        entries[spec["name"]] = entry
    return entries
