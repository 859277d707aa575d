"""Export FedCRef's community autoencoders to ONNX, with the index a device labels by."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edge_sdk.fedcref import ARCHITECTURES

__all__ = ["export_communities"]


def export_communities(
    community_models: Mapping[int, Mapping[str, np.ndarray]],
    architecture: str,
    out_dir: str | os.PathLike[str],
    *,
    members: Optional[Mapping[int, Sequence[str]]] = None,
    metadata: Optional[Mapping[str, Any]] = None,
) -> list[Path]:
    """Export community autoencoders to ONNX (output: the reconstruction) with an index.

    Writes ``community_<g>.onnx`` (input ``x`` ``(batch, d)``, output
    ``x_hat``, dynamic batch, checked against torch with ONNX Runtime to
    1e-5) for every community and ``communities.json`` listing file, sha256,
    community id and member clusters. :class:`edge_sdk.fedcref.OnnxCommunityLabeler`
    reads that folder.

    Returns
    -------
    list of pathlib.Path
        The ONNX files in community order.
    """
    import torch

    from edge_sdk.fedcref import build_cluster_ae
    from edge_sdk.models.artifacts import sha256_file

    from ..export import OPSET, export_onnx, verify_onnx

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown FedCRef architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    if not community_models:
        raise ValueError("no community models to export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = ARCHITECTURES[architecture][0]
    entries, paths = [], []
    for g in sorted(community_models):
        model = build_cluster_ae(architecture)
        model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32))
                               for k, v in community_models[g].items()}, strict=True)
        model.eval()
        path = out / f"community_{int(g):02d}.onnx"
        export_onnx(model, path, (d,), output_name="x_hat")
        verify_onnx(path, model, (d,), output_name="x_hat")
        paths.append(path)
        entries.append({"community": int(g), "file": path.name, "sha256": sha256_file(path),
                        "members": list((members or {}).get(g, [])), "input_name": "x", "output_name": "x_hat",
                        "input_shape": [d], "input_range": [0.0, 1.0]})
    index = {"format_version": 1, "architecture": architecture, "opset": OPSET,
             "rule": "label = community whose autoencoder has the lowest mean squared reconstruction error",
             "communities": entries, **dict(metadata or {})}
    (out / "communities.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths
