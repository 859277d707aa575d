"""The files an export writes besides ONNX: safetensors weights and ``manifest.json``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from edge_sdk.models.artifacts import MANIFEST_NAME
from server_kit.nets import build_model

__all__ = ["MANIFEST_FORMAT_VERSION", "load_weights", "read_manifest", "save_weights", "update_manifest"]

logger = logging.getLogger(__name__)

MANIFEST_FORMAT_VERSION = 1


# --------------------------------------------------------------------------- weights


def save_weights(module: nn.Module, path: str | os.PathLike[str], architecture: str) -> None:
    """Write ``module.state_dict()`` (buffers included) as safetensors.

    Parameters
    ----------
    module : torch.nn.Module
        The model.
    path : str or os.PathLike
        Destination ``.safetensors`` file.
    architecture : str
        Recorded in the file's metadata.
    """
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    # One metadata key only: safetensors serialises the metadata map in hash
    # order, so several keys would make the bytes (and the sha256) vary per run.
    save_file(state, str(path), metadata={"architecture": architecture})
    os.chmod(path, 0o644)  # safetensors creates the file owner-only; it is package data
    logger.info("wrote %s (%d tensors)", path, len(state))


def load_weights(path: str | os.PathLike[str], architecture: str) -> nn.Module:
    """Rebuild a registered architecture from a safetensors file, in eval mode.

    Parameters
    ----------
    path : str or os.PathLike
        A file written by :func:`save_weights`.
    architecture : str
        A key of :data:`server_kit.nets.ARCHITECTURES`.

    Returns
    -------
    torch.nn.Module
        The model with the stored weights (strict key match).
    """
    from safetensors.torch import load_file

    model = build_model(architecture)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()


# --------------------------------------------------------------------------- manifest


def read_manifest(out: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw manifest of folder ``out`` (an empty one when there is none).

    Raises
    ------
    ValueError
        If the file is not JSON or has another format version.
    """
    path = Path(out) / MANIFEST_NAME
    if not path.is_file():
        return {"format_version": MANIFEST_FORMAT_VERSION, "artifacts": {}}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    version = raw.get("format_version")
    if version != MANIFEST_FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {version!r}; this recipe writes {MANIFEST_FORMAT_VERSION}"
        )
    if not isinstance(raw.get("artifacts"), dict):
        raise ValueError(f"{path} has no 'artifacts' mapping")
    return raw


def update_manifest(out: str | os.PathLike[str], entries: Mapping[str, Mapping[str, Any]]) -> Path:
    """Add or replace ``entries`` in ``out/manifest.json``, keeping the others.

    Parameters
    ----------
    out : str or os.PathLike
        The models folder.
    entries : mapping
        Artifact name -> manifest entry.

    Returns
    -------
    pathlib.Path
        The manifest path.
    """
    raw = read_manifest(out)
    raw["artifacts"].update({k: dict(v) for k, v in entries.items()})
    path = Path(out) / MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(raw, sort_keys=True, indent=2) + "\n")
    os.replace(tmp, path)
    logger.info("updated %s: %s", path, ", ".join(sorted(entries)))
    return path
