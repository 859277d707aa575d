"""The export of a pre-trained autoencoder's encoder: one ONNX file with its manifest entry."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

__all__ = ["ExportedEncoder", "export_encoder"]


@dataclass(frozen=True)
class ExportedEncoder:
    """The ONNX encoder :func:`export_encoder` wrote; usable as a path (``os.fspath``).

    Attributes
    ----------
    name : str
        Its artifact name in the manifest.
    path : pathlib.Path
        The ``.onnx`` file.
    nbytes : int
        Size of the file: what the server sends each client that sketches.
    sha256 : str
        The hash recorded in the manifest.
    models_dir : pathlib.Path
        The folder holding the file and ``manifest.json``.
    entry : dict
        The manifest entry written.
    """

    name: str
    path: Path
    nbytes: int
    sha256: str
    models_dir: Path
    entry: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __fspath__(self) -> str:
        return os.fspath(self.path)


def export_encoder(
    weights: Mapping[str, np.ndarray],
    architecture: str,
    out_dir: str | os.PathLike[str],
    name: str = "fed_ae_encoder",
    *,
    metadata: Optional[Mapping[str, Any]] = None,
) -> ExportedEncoder:
    """Export the encoder of autoencoder ``weights`` to ONNX, with a manifest entry.

    Writes ``<name>.onnx`` (the encoder alone, dynamic batch axis, output
    ``z``), the whole autoencoder's weights as safetensors (``<stem>.safetensors``,
    ``<stem>`` being ``name`` without a trailing ``_encoder``, else
    ``<name>_weights``) and adds or replaces the ``name`` entry of
    ``out_dir/manifest.json`` (other entries are kept). The ONNX file is
    checked against the torch encoder by :func:`server_kit.export.verify_onnx`
    (absolute difference below 1e-5) before the manifest is written.

    Parameters
    ----------
    weights : mapping of str to numpy.ndarray
        A ``state_dict`` of ``architecture`` (for example
        :attr:`PretrainResult.weights`).
    architecture : str
        Autoencoder key of :data:`server_kit.nets.ARCHITECTURES`.
    out_dir : str or os.PathLike
        Destination folder (created if needed).
    name : str
        Artifact name (and file stem) of the encoder.
    metadata : mapping, optional
        Extra JSON-serialisable fields for the manifest entry (for example
        the pre-training settings and bytes).

    Returns
    -------
    ExportedEncoder
        Path, size in bytes, sha256 and folder of the encoder; it is
        path-like, so ``OnnxEncoder(result)`` and
        ``OnnxEncoder(name, models_dir=out_dir)`` both load it.

    Raises
    ------
    ValueError
        On an unknown or non-autoencoder architecture, weights that do not
        fit it, or a name that is not a plain file stem.
    """
    model = _load_autoencoder(weights, architecture, name)
    sample_shape, fields, common = _manifest_fields(model, metadata)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entry = _write_encoder(model, architecture, out, name, sample_shape, fields, common)
    path = out / entry["file"]
    return ExportedEncoder(
        name=name,
        path=path,
        nbytes=int(path.stat().st_size),
        sha256=str(entry["sha256"]),
        models_dir=out,
        entry=dict(entry),
    )


def _load_autoencoder(weights: Mapping[str, np.ndarray], architecture: str, name: str) -> Any:
    """The autoencoder ``architecture`` holding ``weights``, in eval mode (``name`` checked first)."""
    import torch

    from server_kit.nets import ARCHITECTURES, build_model

    if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"name must be a plain file stem, got {name!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    model = build_model(architecture)
    if not callable(getattr(model, "encode", None)) or not hasattr(model, "encoder"):
        raise ValueError(f"architecture {architecture!r} is not an autoencoder")
    try:
        state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"weights do not fit architecture {architecture!r}: {e}") from None
    model.eval()
    return model


def _manifest_fields(
    model: Any, metadata: Optional[Mapping[str, Any]]
) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """The encoder's sample shape, its own manifest fields and those of the family (``metadata`` last)."""
    latent = int(model.latent_dim)
    if hasattr(model, "in_features"):
        sample_shape = [int(model.in_features)]
        side = math.isqrt(sample_shape[0])
        image_shape = [side, side] if side * side == sample_shape[0] else None
        channels = 1
    else:  # the convolutional autoencoder
        sample_shape = [int(model.channels[0]), 32, 32]
        image_shape = [32, 32]
        channels = int(model.channels[0])
    fields: dict[str, Any] = {"latent_dim": latent, "output_shape": [latent]}
    if hasattr(model, "latent_shape"):
        fields["latent_shape"] = list(model.latent_shape)
    common: dict[str, Any] = {
        "channels": channels,
        "trained": True,
        "training_data": "federated pre-training on the clients' own images (server_kit.pretrain)",
        "recipe": "server_kit.pretrain.export_encoder(federated_ae_pretrain(...).weights, ...)",
    }
    if image_shape is not None:
        common["image_shape"] = image_shape
    if channels > 1:
        common["layout"] = "NCHW"
    if metadata:
        common.update(dict(metadata))
    return sample_shape, fields, common


def _write_encoder(
    model: Any,
    architecture: str,
    out: Path,
    name: str,
    sample_shape: Sequence[int],
    fields: dict[str, Any],
    common: dict[str, Any],
) -> dict[str, Any]:
    """Write and verify the encoder and the weights, update the manifest; the encoder's entry."""
    from server_kit.export import export_family, update_manifest
    from server_kit.nets import EncoderOnly, count_params

    stem = name[: -len("_encoder")] if name.endswith("_encoder") and name != "_encoder" else ""
    entries = export_family(
        model,
        out=out,
        architecture=architecture,
        weights_name=stem or f"{name}_weights",
        exports=[
            {
                "name": name,
                "module": EncoderOnly(model),
                "params": count_params(model.encoder),
                "role": "encoder",
                "output_name": "z",
                "sample_shape": sample_shape,
                "fields": fields,
            }
        ],
        common=common,
    )
    update_manifest(out, entries)
    return entries[name]
