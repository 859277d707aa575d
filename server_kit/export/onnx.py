"""torch -> ONNX: the export of one module to a self-contained file, and its checks against torch."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["OPSET", "STRIPPED_METADATA", "VERIFY_ATOL", "export_onnx", "initializer_names", "verify_onnx"]

logger = logging.getLogger(__name__)

#: ONNX opset of every export (onnxruntime >= 1.14 runs it).
OPSET = 18
#: Largest tolerated |onnxruntime - torch| on the verification batches.
VERIFY_ATOL = 1e-5


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
