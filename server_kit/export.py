"""Train and export the shipped model artifacts (ONNX + safetensors + manifest).

Run as ``python -m server_kit.export <target> [--data DIR] [--out models]
[--epochs N] [--seed S]`` (or ``fedsketch export ...``). Targets:

``fmnist-fc-ae``
    :class:`~server_kit.nets.FCAutoencoder` (784, 50, 20) trained on
    Fashion-MNIST train (``--data`` holds the IDX files), MSE, Adam lr 1e-3,
    batch 32, 20 epochs. Writes ``fmnist_fc_encoder.onnx``,
    ``fmnist_fc_ae.onnx`` and ``fmnist_fc_ae.safetensors``.
``digits-ae``
    ``FCAutoencoder(64, 48, 20)`` trained on scikit-learn's 8x8 digits with
    the four 90-degree rotations of every image. Writes
    ``digits_encoder.onnx``, ``digits_ae.onnx`` and ``digits_ae.safetensors``.
``conv-ae``
    :class:`~server_kit.nets.ConvAutoencoder` with seeded, untrained weights.
``lenet5``
    :class:`~server_kit.nets.LeNet5` with seeded initial weights (the common
    starting point of federated training).
``digits-cnn``
    :class:`~server_kit.nets.DigitsCNN` (8x8 digits classifier) with seeded
    initial weights.
``all``
    All of the above (``--data`` then applies to ``fmnist-fc-ae``).

Every ONNX file is self-contained (no external data), has a dynamic batch
dimension, and is checked against torch with onnxruntime right after it is
written. ``manifest.json`` in the output folder is updated in place: other
targets' entries are kept.

Classifier templates (``lenet5``, ``digits-cnn``) also record
``initializer_names``, a map from every ``state_dict`` key to the ONNX
initializer holding that tensor, unchanged (same shape, same values). A
device without torch evaluates received weights by overriding those
initializers in an ONNX Runtime session (:func:`edge_sdk.trainer.evaluate`);
the export fails if a tensor cannot be found, for example because the
exporter folded or transposed it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edge_sdk.artifacts import MANIFEST_NAME, sha256_file
from server_kit.nets import ConvAutoencoder, EncoderOnly, build_model, count_params

__all__ = [
    "CLASSIFIER_TARGETS",
    "DEFAULT_EPOCHS",
    "MANIFEST_FORMAT_VERSION",
    "OPSET",
    "TARGETS",
    "evaluate_mse",
    "export_classifier",
    "export_onnx",
    "export_target",
    "initializer_names",
    "load_weights",
    "main",
    "read_manifest",
    "save_weights",
    "train_autoencoder",
    "update_manifest",
    "verify_onnx",
]

logger = logging.getLogger(__name__)

MANIFEST_FORMAT_VERSION = 1
#: ONNX opset of every export (onnxruntime >= 1.14 runs it).
OPSET = 18
#: The digits autoencoder: 64 -> 48 -> 20. Its 200-bit sketches (10 classes x 20)
#: separate the four rotation groups of the demo at P = 0.1 with refinement in
#: every one of 21 seeded federations tried (12 and 20 clients); the earlier
#: 64 -> 32 -> 16 (160 bits) put a digit and its 180-degree turn 23 bits apart
#: and missed one client in one of 8.
DIGITS_AE_ARCH = "fc_ae_64_48_20"

TARGETS: tuple[str, ...] = ("fmnist-fc-ae", "digits-ae", "conv-ae", "lenet5", "digits-cnn")
#: Targets that train; the others export seeded initial weights.
DEFAULT_EPOCHS: dict[str, int] = {"fmnist-fc-ae": 20, "digits-ae": 60}
BATCH_SIZE = 32
LEARNING_RATE = 1e-3
#: Largest tolerated |onnxruntime - torch| on the verification batches.
VERIFY_ATOL = 1e-5
UNIT_RANGE = [0.0, 1.0]
CONV_AE_TRAINING_DATA = (
    "none (seeded, untrained weights; the paper pre-trains this autoencoder on CIFAR-100 train "
    "for 50 epochs, which this recipe does not do)"
)


# --------------------------------------------------------------------------- utilities


def seed_everything(seed: int) -> None:
    """Seed torch and numpy and ask torch for deterministic kernels.

    Parameters
    ----------
    seed : int
        The seed.
    """
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))  # noqa: NPY002 - the legacy global RNG, for third-party code
    torch.use_deterministic_algorithms(True, warn_only=True)


def _progress(iterable: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """Wrap ``iterable`` in a tqdm bar when tqdm is installed and stderr is a terminal."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, disable=None)


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


# --------------------------------------------------------------------------- training


def train_autoencoder(
    model: nn.Module,
    data: np.ndarray,
    *,
    epochs: int,
    seed: int,
    batch_size: int = BATCH_SIZE,
    lr: float = LEARNING_RATE,
    desc: str = "train",
) -> list[float]:
    """Train an autoencoder to reconstruct ``data`` with MSE and Adam.

    Parameters
    ----------
    model : torch.nn.Module
        Maps a batch to its reconstruction (same shape).
    data : numpy.ndarray
        ``float32`` samples in [0, 1], first axis the sample axis.
    epochs : int
        Passes over the data (a fresh seeded shuffle each).
    seed : int
        Seed of the shuffling generator.
    batch_size : int
        Mini-batch size.
    lr : float
        Adam learning rate.
    desc : str
        Label for progress and log lines.

    Returns
    -------
    list of float
        Mean training loss (per element) of every epoch, measured during it.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    n = x.shape[0]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.MSELoss()
    history: list[float] = []
    model.train()
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=gen)
        total = torch.zeros((), dtype=torch.float64)
        starts = range(0, n, batch_size)
        for start in _progress(starts, f"{desc} {epoch}/{epochs}", total=len(starts)):
            xb = x[perm[start : start + batch_size]]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), xb)
            loss.backward()
            opt.step()
            total += loss.detach().double() * xb.shape[0]
        history.append(float(total) / n)
        logger.info(
            "%s epoch %d/%d: train MSE %.6f (%.1f s)",
            desc,
            epoch,
            epochs,
            history[-1],
            time.perf_counter() - t0,
        )
    model.eval()
    return history


@torch.no_grad()
def evaluate_mse(model: nn.Module, data: np.ndarray, chunk: int = 4096) -> float:
    """Mean squared reconstruction error per element, in eval mode.

    Parameters
    ----------
    model : torch.nn.Module
        Maps a batch to its reconstruction.
    data : numpy.ndarray
        ``float32`` samples, first axis the sample axis.
    chunk : int
        Samples per forward pass.

    Returns
    -------
    float
        ``mean((model(x) - x) ** 2)`` over all samples and elements.
    """
    was_training = model.training
    model.eval()
    x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    sse = 0.0
    for start in range(0, x.shape[0], chunk):
        xb = x[start : start + chunk]
        sse += float(((model(xb) - xb).double() ** 2).sum())
    model.train(was_training)
    return sse / x.numel()


# --------------------------------------------------------------------------- ONNX export


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's harmless warnings (missing torchvision, deprecations)."""
    quiet = {
        "torch.onnx._internal.exporter._registration": logging.ERROR,
        "onnxscript": logging.WARNING,
        "onnx_ir": logging.WARNING,
    }
    saved = {name: logging.getLogger(name).level for name in quiet}
    for name, level in quiet.items():
        logging.getLogger(name).setLevel(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


#: Node metadata removed from every export (machine- and line-dependent).
STRIPPED_METADATA = frozenset({"pkg.torch.onnx.stack_trace"})


def _strip_metadata(model: Any, keys: frozenset[str]) -> int:
    """Delete node metadata entries named in ``keys`` (graph and functions); return how many."""
    removed = 0
    node_lists = [model.graph.node] + [f.node for f in model.functions]
    for nodes in node_lists:
        for node in nodes:
            keep = [p for p in node.metadata_props if p.key not in keys]
            if len(keep) != len(node.metadata_props):
                removed += len(node.metadata_props) - len(keep)
                kept = [(p.key, p.value) for p in keep]
                del node.metadata_props[:]
                for k, v in kept:
                    node.metadata_props.add(key=k, value=v)
    return removed


def export_onnx(
    module: nn.Module,
    path: str | os.PathLike[str],
    sample_shape: Sequence[int],
    *,
    input_name: str = "x",
    output_name: str = "z",
    opset: int = OPSET,
) -> int:
    """Export ``module`` to a self-contained ONNX file with a dynamic batch axis.

    Uses the torch.export based exporter (``dynamo=True``); the batch axis is
    declared with ``dynamic_shapes`` and traced with a batch of 2 so that it
    is not specialised. The exporter's per-node Python stack traces
    (metadata ``pkg.torch.onnx.stack_trace``) are removed: they hold absolute
    source paths and line numbers, so the bytes (and the sha256) would change
    with the checkout's location and with every edit of the model's module.
    The file is written next to ``path`` and renamed into place once
    complete.

    Parameters
    ----------
    module : torch.nn.Module
        The module, put in eval mode here.
    path : str or os.PathLike
        Destination ``.onnx`` file.
    sample_shape : sequence of int
        Shape of one sample (batch axis excluded).
    input_name, output_name : str
        Graph input and output names.
    opset : int
        ONNX opset version.

    Returns
    -------
    int
        The ONNX IR version of the written file.

    Raises
    ------
    RuntimeError
        If the exporter fails or the file would need external data.
    """
    import onnx
    from onnx.external_data_helper import uses_external_data

    path = Path(path)
    module.eval()
    example = (torch.rand(2, *sample_shape),)
    batch = torch.export.Dim("batch", min=1)
    tmp = path.with_name(path.name + ".tmp")
    with _quiet_exporter():
        program = torch.onnx.export(
            module,
            example,
            input_names=[input_name],
            output_names=[output_name],
            opset_version=opset,
            dynamo=True,
            dynamic_shapes=({0: batch},),
            verbose=False,
        )
        if program is None:  # pragma: no cover - the dynamo path always returns a program
            raise RuntimeError(f"torch.onnx.export returned no program for {path.name}")
        program.save(tmp, external_data=False)
    model = onnx.load(str(tmp), load_external_data=False)
    if any(uses_external_data(t) for t in model.graph.initializer):
        tmp.unlink()
        raise RuntimeError(f"{path.name}: the export refers to external data files")
    if _strip_metadata(model, STRIPPED_METADATA):
        onnx.save(model, str(tmp))
    onnx.checker.check_model(model)
    os.replace(tmp, path)
    logger.info("wrote %s (%d bytes, opset %d)", path, path.stat().st_size, opset)
    return int(model.ir_version)


@torch.no_grad()
def verify_onnx(
    path: str | os.PathLike[str],
    module: nn.Module,
    sample_shape: Sequence[int],
    *,
    input_name: str = "x",
    output_name: str = "z",
    batch_sizes: Sequence[int] = (3, 1),
    atol: float = VERIFY_ATOL,
    seed: int = 0,
) -> float:
    """Run an ONNX file with onnxruntime and compare it to ``module``.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.onnx`` file.
    module : torch.nn.Module
        The reference (evaluated in eval mode).
    sample_shape : sequence of int
        Shape of one sample.
    input_name, output_name : str
        Expected graph input and output names.
    batch_sizes : sequence of int
        Batch sizes of the random uniform [0, 1) test inputs.
    atol : float
        Largest tolerated absolute difference.
    seed : int
        Seed of the test inputs.

    Returns
    -------
    float
        The largest absolute difference seen.

    Raises
    ------
    RuntimeError
        If names, shapes or values disagree.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    if inputs != [input_name] or outputs != [output_name]:
        raise RuntimeError(
            f"{path}: graph has inputs {inputs} and outputs {outputs}, "
            f"expected [{input_name!r}] and [{output_name!r}]"
        )
    module.eval()
    rng = np.random.default_rng(seed)
    worst = 0.0
    for b in batch_sizes:
        x = rng.random((b, *sample_shape), dtype=np.float32)
        got = session.run([output_name], {input_name: x})[0]
        want = module(torch.from_numpy(x)).numpy()
        if got.shape != want.shape:
            raise RuntimeError(f"{path}: batch {b} gives shape {got.shape}, torch {want.shape}")
        diff = float(np.max(np.abs(got - want)))
        worst = max(worst, diff)
        if not diff < atol:
            raise RuntimeError(
                f"{path}: onnxruntime differs from torch by {diff:.3g} (> {atol:g}) on batch {b}"
            )
    logger.info("verified %s against torch: max |diff| %.3g", Path(path).name, worst)
    return worst


def initializer_names(path: str | os.PathLike[str], module: nn.Module) -> dict[str, str]:
    """Map each ``state_dict`` key of ``module`` to the ONNX initializer that holds it.

    A key maps to the initializer of the same name when shape and values are
    equal (what the exporter does for plain convolution and linear layers);
    otherwise to the only initializer with that shape and those exact values.
    Integer buffers (such as BatchNorm's ``num_batches_tracked``) do not
    affect inference and are left out.

    Parameters
    ----------
    path : str or os.PathLike
        The exported ``.onnx`` file.
    module : torch.nn.Module
        The module it was exported from.

    Returns
    -------
    dict
        ``state_dict`` key -> initializer name (identical in the shipped files).

    Raises
    ------
    RuntimeError
        If a floating-point tensor is not stored unchanged in exactly one
        initializer (folded, transposed or duplicated by the exporter).
    """
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    mapping: dict[str, str] = {}
    for key, tensor in module.state_dict().items():
        if not tensor.is_floating_point():
            continue
        want = tensor.detach().cpu().numpy()
        same = inits.get(key)
        if same is not None and same.shape == want.shape and np.array_equal(same, want):
            mapping[key] = key
            continue
        found = [n for n, a in inits.items() if a.shape == want.shape and np.array_equal(a, want)]
        if len(found) != 1:
            raise RuntimeError(
                f"{Path(path).name}: state_dict tensor {key!r} {tuple(want.shape)} is "
                f"{'stored in several initializers ' + str(found) if found else 'not stored unchanged in any initializer'}; "
                "its weights could not be replaced in onnxruntime"
            )
        mapping[key] = found[0]
    return mapping


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


# --------------------------------------------------------------------------- one artifact family


def _recipe(target: str, *, data: str | None, epochs: int | None, seed: int, out: str) -> str:
    """The command line that rebuilds ``target``."""
    parts = ["fedsketch export", target]
    if data is not None:
        parts += ["--data", data]
    if epochs is not None:
        parts += ["--epochs", str(epochs)]
    parts += ["--seed", str(seed), "--out", out]
    return " ".join(parts)


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


def _ae_training(epochs: int, seed: int) -> dict[str, Any]:
    """The training settings an autoencoder's manifest entry records."""
    return {"epochs": epochs, "batch_size": BATCH_SIZE, "optimizer": "adam", "lr": LEARNING_RATE,
            "loss": "mse", "seed": seed}


def _ae_exports(
    prefix: str, model: nn.Module, sample_shape: Sequence[int], ae_output_shape: Sequence[int]
) -> list[dict[str, Any]]:
    """Encoder and full-autoencoder export specs for ``model``."""
    latent = int(model.latent_dim)
    return [
        {
            "name": f"{prefix}_encoder",
            "module": EncoderOnly(model),
            "params": count_params(model.encoder),
            "role": "encoder",
            "output_name": "z",
            "sample_shape": sample_shape,
            "fields": {"latent_dim": latent, "output_shape": [latent]},
        },
        {
            "name": f"{prefix}_ae",
            "module": model,
            "role": "autoencoder",
            "output_name": "x_hat",
            "sample_shape": sample_shape,
            "fields": {"latent_dim": latent, "output_shape": list(ae_output_shape)},
        },
    ]


# --------------------------------------------------------------------------- targets


def _fmnist_arrays(data: Path) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """Fashion-MNIST train and test images as float32 (N, 784) in [0, 1], plus file hashes."""
    from server_kit.data.idx import IDX_FILES, load_idx_dataset

    train_x, _ = load_idx_dataset(data, "train")
    test_x, _ = load_idx_dataset(data, "test")
    if train_x.shape[1:] != (28, 28) or test_x.shape[1:] != (28, 28):
        raise ValueError(f"{data}: expected 28x28 images, got {train_x.shape[1:]}")
    hashes = {}
    for stem in IDX_FILES["train"] + IDX_FILES["test"]:
        for name in (stem + ".gz", stem):
            if (data / name).is_file():
                hashes[name] = sha256_file(data / name)
                break
    to_unit = lambda a: a.reshape(a.shape[0], -1).astype(np.float32) / 255.0  # noqa: E731
    return to_unit(train_x), to_unit(test_x), hashes


def export_fmnist_fc_ae(
    out: Path, *, data: Path, data_arg: str, out_arg: str, epochs: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Train the FC autoencoder on Fashion-MNIST and export it."""
    train, test, hashes = _fmnist_arrays(data)
    logger.info("fmnist-fc-ae: %d train, %d test images", train.shape[0], test.shape[0])
    seed_everything(seed)
    model = build_model("fc_ae_784_50_20")
    history = train_autoencoder(model, train, epochs=epochs, seed=seed, desc="fmnist-fc-ae")
    train_mse, test_mse = evaluate_mse(model, train), evaluate_mse(model, test)
    logger.info("fmnist-fc-ae: train MSE %.6f, test MSE %.6f", train_mse, test_mse)
    common = {
        "image_shape": [28, 28],
        "channels": 1,
        "training_data": (
            f"Fashion-MNIST train split ({train.shape[0]} images, pixels/255); "
            f"test_mse on the t10k split ({test.shape[0]} images)"
        ),
        "data_files": hashes,
        "train_mse": train_mse,
        "test_mse": test_mse,
        "final_epoch_loss": history[-1],
        "training": _ae_training(epochs, seed),
        "recipe": _recipe("fmnist-fc-ae", data=data_arg, epochs=epochs, seed=seed, out=out_arg),
    }
    return export_family(
        model,
        out=out,
        architecture="fc_ae_784_50_20",
        weights_name="fmnist_fc_ae",
        exports=_ae_exports("fmnist_fc", model, [784], [784]),
        common=common,
    )


def digits_arrays() -> np.ndarray:
    """scikit-learn's 8x8 digits with all four 90-degree rotations, float32 (4 * 1797, 64).

    Returns
    -------
    numpy.ndarray
        Rotation ``k`` (0..3, counter-clockwise, :func:`numpy.rot90`) of every
        image, rotations concatenated in order, pixels / 16 in [0, 1].
    """
    from sklearn.datasets import load_digits

    images = load_digits().images.astype(np.float32) / 16.0
    rotated = [np.rot90(images, k, axes=(1, 2)) for k in range(4)]
    return np.concatenate(rotated).reshape(-1, 64).astype(np.float32)


def export_digits_ae(
    out: Path, *, out_arg: str, epochs: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Train the small FC autoencoder on rotated 8x8 digits and export it."""
    data = digits_arrays()
    seed_everything(seed)
    model = build_model(DIGITS_AE_ARCH)
    history = train_autoencoder(model, data, epochs=epochs, seed=seed, desc="digits-ae")
    train_mse = evaluate_mse(model, data)
    logger.info("digits-ae: train MSE %.6f", train_mse)
    common = {
        "image_shape": [8, 8],
        "channels": 1,
        "training_data": (
            f"scikit-learn load_digits(), all 1797 images x 4 rotations (np.rot90 k=0..3) "
            f"= {data.shape[0]} samples, pixels/16"
        ),
        "train_mse": train_mse,
        "final_epoch_loss": history[-1],
        "training": _ae_training(epochs, seed),
        "recipe": _recipe("digits-ae", data=None, epochs=epochs, seed=seed, out=out_arg),
    }
    return export_family(
        model,
        out=out,
        architecture=DIGITS_AE_ARCH,
        weights_name="digits_ae",
        exports=_ae_exports("digits", model, [64], [64]),
        common=common,
    )


def export_conv_ae(out: Path, *, out_arg: str, seed: int) -> dict[str, dict[str, Any]]:
    """Export the convolutional autoencoder with seeded, untrained weights."""
    seed_everything(seed)
    model = build_model("conv_ae_3_12_24_48")
    assert isinstance(model, ConvAutoencoder)
    common = {
        "image_shape": [32, 32],
        "channels": 3,
        "layout": "NCHW",
        "training_data": CONV_AE_TRAINING_DATA,
        "trained": False,
        "recipe": _recipe("conv-ae", data=None, epochs=None, seed=seed, out=out_arg),
    }
    exports = _ae_exports("conv_ae", model, [3, 32, 32], [3, 32, 32])
    exports[0]["fields"]["latent_shape"] = list(model.latent_shape)
    # The full autoencoder's file is conv_ae.onnx, not conv_ae_ae.onnx.
    exports[1]["name"] = "conv_ae"
    return export_family(
        model,
        out=out,
        architecture="conv_ae_3_12_24_48",
        weights_name="conv_ae",
        exports=exports,
        common=common,
    )


#: Classifier targets: target -> (architecture, artifact name, per-sample input
#: shape, image shape, dataset the classifier is meant for).
CLASSIFIER_TARGETS: dict[str, tuple[str, str, tuple[int, ...], tuple[int, int], str]] = {
    "lenet5": ("lenet5_1x28x28_10", "lenet5", (1, 28, 28), (28, 28), "28x28 grey images (MNIST)"),
    "digits-cnn": (
        "digits_cnn_1x8x8_10",
        "digits_cnn",
        (1, 8, 8),
        (8, 8),
        "scikit-learn's 8x8 digits (pixels / 16)",
    ),
}


def export_classifier(
    target: str, out: Path, *, out_arg: str, seed: int
) -> dict[str, dict[str, Any]]:
    """Export a classifier template with seeded initial weights (logits output).

    Parameters
    ----------
    target : str
        A key of :data:`CLASSIFIER_TARGETS` (``lenet5``, ``digits-cnn``).
    out : pathlib.Path
        Output folder.
    out_arg : str
        How ``out`` was spelled on the command line.
    seed : int
        Seed of the initial weights (``torch.manual_seed`` before building).

    Returns
    -------
    dict
        Artifact name -> manifest entry (one entry, with ``initializer_names``).
    """
    architecture, name, sample_shape, image_shape, meant_for = CLASSIFIER_TARGETS[target]
    seed_everything(seed)
    model = build_model(architecture)
    num_classes = int(model.num_classes)
    common = {
        "image_shape": list(image_shape),
        "channels": int(sample_shape[0]),
        "layout": "NCHW",
        "num_classes": num_classes,
        "output_shape": [num_classes],
        "training_data": (
            f"none (seeded initial weights, the common start of federated training on {meant_for})"
        ),
        "trained": False,
        "recipe": _recipe(target, data=None, epochs=None, seed=seed, out=out_arg),
    }
    exports = [
        {
            "name": name,
            "module": model,
            "role": "classifier",
            "output_name": "logits",
            "sample_shape": list(sample_shape),
            "map_initializers": True,
        }
    ]
    return export_family(
        model,
        out=out,
        architecture=architecture,
        weights_name=name,
        exports=exports,
        common=common,
    )


def export_lenet5(out: Path, *, out_arg: str, seed: int) -> dict[str, dict[str, Any]]:
    """Export LeNet-5 with seeded initial weights (logits output)."""
    return export_classifier("lenet5", out, out_arg=out_arg, seed=seed)


def export_target(
    target: str,
    out: str | os.PathLike[str] = "models",
    *,
    data: str | os.PathLike[str] | None = None,
    epochs: int | None = None,
    seed: int = 0,
    out_arg: str | None = None,
    data_arg: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Build one target's artifacts in ``out`` and update the manifest there.

    Parameters
    ----------
    target : str
        One of :data:`TARGETS`.
    out : str or os.PathLike
        Output folder (created if needed).
    data : str or os.PathLike, optional
        Dataset folder; required by ``fmnist-fc-ae``, refused by the others.
    epochs : int, optional
        Training epochs (default :data:`DEFAULT_EPOCHS`); trained targets only.
    seed : int
        Seed of weights initialisation and shuffling.
    out_arg, data_arg : str, optional
        How ``out`` and ``data`` were spelled on the command line (for the
        recipe string); default ``str(out)`` and ``str(data)``.

    Returns
    -------
    dict
        The manifest entries written.

    Raises
    ------
    ValueError
        On an unknown target, a missing or unexpected ``--data``, or bad epochs.
    FileNotFoundError
        If ``data`` is not a directory or lacks a file.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {list(TARGETS) + ['all']}")
    if target == "fmnist-fc-ae" and data is None:
        raise ValueError(
            "fmnist-fc-ae needs --data DIR, the folder holding the Fashion-MNIST IDX files "
            "(train-images-idx3-ubyte.gz, ...)"
        )
    if target != "fmnist-fc-ae" and data is not None:
        hint = (
            "conv-ae is exported untrained: training on CIFAR-100 is not part of this recipe"
            if target == "conv-ae"
            else f"{target} does not read a dataset folder"
        )
        raise ValueError(f"--data is not accepted for {target}: {hint}")
    if data is not None and not Path(data).is_dir():
        raise FileNotFoundError(f"--data {data}: no such directory")
    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    out_arg = str(out) if out_arg is None else out_arg
    if target == "fmnist-fc-ae" and data is not None:
        n = DEFAULT_EPOCHS[target] if epochs is None else int(epochs)
        entries = export_fmnist_fc_ae(
            out_path,
            data=Path(data),
            data_arg=str(data) if data_arg is None else data_arg,
            out_arg=out_arg,
            epochs=n,
            seed=seed,
        )
    elif target == "digits-ae":
        n = DEFAULT_EPOCHS[target] if epochs is None else int(epochs)
        entries = export_digits_ae(out_path, out_arg=out_arg, epochs=n, seed=seed)
    elif target == "conv-ae":
        entries = export_conv_ae(out_path, out_arg=out_arg, seed=seed)
    else:
        entries = export_classifier(target, out_path, out_arg=out_arg, seed=seed)
    update_manifest(out_path, entries)
    return entries


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The ``fedsketch export`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fedsketch export",
        description="Train and export the shipped ONNX/safetensors artifacts and update manifest.json.",
    )
    p.add_argument("target", choices=[*TARGETS, "all"], help="what to build")
    p.add_argument(
        "--data",
        default=None,
        help="Fashion-MNIST IDX folder (fmnist-fc-ae; with 'all' it applies to fmnist-fc-ae only)",
    )
    p.add_argument("--out", default="models", help="output folder (default: models)")
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"training epochs of the trained targets (defaults: {DEFAULT_EPOCHS})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    return p


def _run_targets(args: argparse.Namespace) -> list[tuple[str, dict[str, dict[str, Any]], float]]:
    """Build every requested target; return (target, entries, seconds) per target."""
    targets = TARGETS if args.target == "all" else (args.target,)
    if "fmnist-fc-ae" in targets and args.data is None:
        raise ValueError("fmnist-fc-ae needs --data DIR (the Fashion-MNIST IDX folder)")
    if args.epochs is not None and args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    done = []
    for target in targets:
        data = args.data if target == "fmnist-fc-ae" or args.target != "all" else None
        t0 = time.perf_counter()
        entries = export_target(
            target,
            args.out,
            data=data,
            epochs=args.epochs if target in DEFAULT_EPOCHS else None,
            seed=args.seed,
            out_arg=args.out,
            data_arg=data,
        )
        seconds = time.perf_counter() - t0
        logger.info("%s done in %.1f s", target, seconds)
        done.append((target, entries, seconds))
    return done


def _summary(done: Sequence[tuple[str, Mapping[str, Mapping[str, Any]], float]], out: str) -> str:
    """Human-readable table of what was written."""
    lines = [f"artifacts written to {out}/ ({MANIFEST_NAME} updated):"]
    for target, entries, seconds in done:
        lines.append(f"  {target} ({seconds:.1f} s)")
        for _name, e in sorted(entries.items()):
            mse = "".join(f" {k}={e[k]:.5f}" for k in ("train_mse", "test_mse") if k in e)
            lines.append(
                f"    {e['file']:<24} {e['role']:<11} in={e['input_shape']} "
                f"params={e['params']}{mse} sha256={e['sha256'][:12]}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m server_kit.export`` and ``fedsketch export``.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success, 2 on a usage or data error.
    """
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=getattr(logging, str(args.log_level).upper(), logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        done = _run_targets(args)
    except (ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 2
    print(_summary(done, args.out))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
