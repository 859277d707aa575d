"""Shipped model artifacts: where they live, what the manifest says, hash checks.

The ONNX files and their ``manifest.json`` sit in the repository's ``models/``
folder and install as the package data ``edge_sdk.artifacts_data``. Every
artifact is described by a manifest entry (sha256, input shape, latent size,
training data, the command that rebuilds it); :func:`artifact_path` refuses a
file whose bytes do not match its recorded hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST_NAME",
    "ArtifactHashError",
    "ArtifactSpec",
    "artifact_path",
    "load_manifest",
    "models_dir",
    "sha256_file",
]

MANIFEST_NAME = "manifest.json"
#: Environment variable that points the package at another models folder.
MODELS_ENV = "FEDSKETCH_MODELS_DIR"


class ArtifactHashError(ValueError):
    """A model file's sha256 differs from the one its manifest records."""


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def models_dir() -> Path:
    """The folder holding the shipped artifacts and their manifest.

    Order: ``$FEDSKETCH_MODELS_DIR``; the installed package data
    ``edge_sdk/artifacts_data``; the source checkout's ``models/``.
    """
    env = os.environ.get(MODELS_ENV)
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent  # edge_sdk/
    for candidate in (here / "artifacts_data", here.parent / "models"):
        if (candidate / MANIFEST_NAME).is_file():
            return candidate
    raise FileNotFoundError(
        f"no {MANIFEST_NAME} found in {here / 'artifacts_data'} or {here.parent / 'models'}; "
        f"set {MODELS_ENV} to the folder that holds the ONNX artifacts"
    )


@dataclass(frozen=True)
class ArtifactSpec:
    """One manifest entry, validated."""

    name: str
    file: str
    sha256: str
    role: str
    input_shape: tuple[int, ...]
    input_dtype: str = "float32"
    input_name: str = "x"
    output_name: str = "z"
    image_shape: tuple[int, ...] | None = None
    input_range: tuple[float, float] | None = None
    latent_dim: int | None = None
    num_classes: int | None = None
    training_data: str = ""
    recipe: str = ""
    extra: Mapping[str, Any] | None = None

    @classmethod
    def from_entry(cls, name: str, entry: Mapping[str, Any]) -> ArtifactSpec:
        missing = [k for k in ("file", "sha256", "role", "input_shape") if k not in entry]
        if missing:
            raise ValueError(f"manifest entry {name!r} lacks required keys {missing}")
        known = {f for f in cls.__dataclass_fields__ if f not in ("name", "extra")}
        rng = entry.get("input_range")
        img = entry.get("image_shape")
        return cls(
            name=name,
            file=str(entry["file"]),
            sha256=str(entry["sha256"]).lower(),
            role=str(entry["role"]),
            input_shape=tuple(int(d) for d in entry["input_shape"]),
            input_dtype=str(entry.get("input_dtype", "float32")),
            input_name=str(entry.get("input_name", "x")),
            output_name=str(entry.get("output_name", "z")),
            image_shape=None if img is None else tuple(int(d) for d in img),
            input_range=None if rng is None else (float(rng[0]), float(rng[1])),
            latent_dim=None if entry.get("latent_dim") is None else int(entry["latent_dim"]),
            num_classes=None if entry.get("num_classes") is None else int(entry["num_classes"]),
            training_data=str(entry.get("training_data", "")),
            recipe=str(entry.get("recipe", "")),
            extra={k: v for k, v in entry.items() if k not in known},
        )


def load_manifest(directory: str | os.PathLike[str] | None = None) -> dict[str, ArtifactSpec]:
    """Read ``manifest.json`` and return its artifacts by name."""
    d = Path(directory) if directory is not None else models_dir()
    path = d / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    arts = raw.get("artifacts")
    if not isinstance(arts, dict):
        raise ValueError(f"{path} has no 'artifacts' mapping")
    return {name: ArtifactSpec.from_entry(name, entry) for name, entry in arts.items()}


def artifact_path(
    name: str, directory: str | os.PathLike[str] | None = None, *, verify: bool = True
) -> tuple[Path, ArtifactSpec]:
    """Locate artifact ``name`` and (by default) check its sha256 against the manifest."""
    d = Path(directory) if directory is not None else models_dir()
    manifest = load_manifest(d)
    if name not in manifest:
        raise KeyError(f"unknown artifact {name!r}; the manifest lists {sorted(manifest)}")
    spec = manifest[name]
    path = d / spec.file
    if not path.is_file():
        raise FileNotFoundError(f"artifact {name!r}: file {path} is missing")
    if verify:
        actual = sha256_file(path)
        if actual != spec.sha256:
            raise ArtifactHashError(
                f"artifact {name!r} ({path}) has sha256 {actual}, but the manifest expects "
                f"{spec.sha256}; rebuild it with: {spec.recipe or 'its recipe'}"
            )
    return path, spec


def _size(shape: tuple[int, ...] | None) -> int:
    n = 1
    for d in shape or ():
        n *= int(d)
    return n


def models_for_shape(sample_shape: tuple[int, ...], directory: str | os.PathLike[str] | None = None
                     ) -> tuple[str | None, str | None]:
    """The shipped encoder and classifier architecture that take samples of ``sample_shape``.

    Samples match an artifact when they hold as many values as its input
    (8x8, (1, 8, 8) and 64 all fit the digits models; 28x28 fits the
    Fashion-MNIST encoder and LeNet-5). Returns ``(encoder name, architecture)``,
    either None when nothing shipped fits.
    """
    n = _size(tuple(sample_shape))
    manifest = load_manifest(directory)
    encoders = sorted(k for k, s in manifest.items() if s.role == "encoder" and _size(s.input_shape) == n)
    classifiers = sorted(str((s.extra or {}).get("architecture")) for s in manifest.values()
                         if s.role == "classifier" and _size(s.input_shape) == n and (s.extra or {}).get("architecture"))
    return (encoders[0] if encoders else None), (classifiers[0] if classifiers else None)


def input_size(name: str, directory: str | os.PathLike[str] | None = None) -> int | None:
    """How many values one sample of shipped encoder or architecture ``name`` holds (None: not shipped)."""
    for key, spec in load_manifest(directory).items():
        if key == name or (spec.extra or {}).get("architecture") == name:
            return _size(spec.input_shape)
    return None
