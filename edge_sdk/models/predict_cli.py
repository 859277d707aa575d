"""``fedsketch predict``: run a kept or exported model on a local ``.npz`` file (ONNX Runtime only, no torch).

    fedsketch predict --model DIR --data FILE.npz [--json OUT] [--proba]

``DIR`` is a device's model folder (``fedsketch-client --model-dir``: its
``current`` model) or one model folder (``model.json`` inside, as the server
exports them); :class:`edge_sdk.LocalModel` loads and checks it. ``FILE.npz``
is read without pickle: array ``x`` (samples in [0, 1]) and, when present,
``y`` (integer labels). stdout: a header line naming the model, one line per
sample (index, predicted class and, with ``--proba``, the probabilities to 4
decimals), then the accuracy when labels are there. Anything unusable (the
model folder, the file, the arrays) is one ``fedsketch predict: error: ...``
line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any, Optional

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = """\
Run a kept or exported model on local samples with ONNX Runtime (no torch): the predicted class of each
sample, with --proba its probabilities, and the accuracy when the file holds labels. --model takes a
device's model folder (its current model) or one model folder (model.json inside)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add every option of ``fedsketch predict`` to ``p``."""
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a device's model folder (fedsketch-client --model-dir) or one model folder")
    p.add_argument("--data", required=True, metavar="FILE.npz",
                   help="samples in [0, 1] (array x) and optionally integer labels (array y); read without pickle")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the model, predictions and accuracy as JSON")
    p.add_argument("--proba", action="store_true", help="print (and write) each sample's class probabilities")
    p.add_argument("--x-key", default="x", help="the samples' array in FILE.npz (default: %(default)s)")
    p.add_argument("--y-key", default=None,
                   help="the labels' array in FILE.npz; an error if missing (default: y, when the file has it)")


def load_arrays(path: str, x_key: str, y_key: Optional[str]) -> tuple[Any, Any]:
    """The samples and the labels of an ``.npz`` file, read without pickle.

    Parameters
    ----------
    path : str
        The ``.npz`` file.
    x_key : str
        The samples' array (must be there).
    y_key : str or None
        The labels' array (must be there); None takes ``y`` when the file has it.

    Returns
    -------
    tuple
        The samples and the labels (None: the file has none), unchecked.

    Raises
    ------
    FileNotFoundError, ValueError
        No such file, not a readable ``.npz`` archive, or a missing array (one line).
    """
    import numpy as np

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        f = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npz archive ({e})") from None
    if not isinstance(f, np.lib.npyio.NpzFile):  # a .npy file: one plain array
        raise ValueError(f"{path}: not an .npz archive (arrays {x_key} and y)")
    with f:
        wanted = [x_key] + ([y_key] if y_key is not None else [])
        missing = [k for k in wanted if k not in f.files]
        if missing:
            raise ValueError(f"{path} lacks arrays {missing}; it holds {f.files}")
        y_name = y_key or "y"
        try:
            return f[x_key], (f[y_name] if y_name in f.files else None)
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:  # a damaged member
            raise ValueError(f"{path}: not a readable .npz archive ({e})") from None


def _model_dict(model: Any) -> dict[str, Any]:
    e = model.info
    return {"key": e.key, "run": e.run, "version": e.version, "architecture": e.architecture,
            "folder": str(model.folder)}


def predict(args: argparse.Namespace) -> dict[str, Any]:
    """Load the model and the data, check them, predict: what ``--json`` writes (probabilities always)."""
    import numpy as np

    from .local_model import LocalModel
    from .model_checks import check_labels

    model = LocalModel.load(args.model)
    x, y = load_arrays(args.data, args.x_key, args.y_key)
    proba = model.predict_proba(x)  # ValueError: shape, dtype, range, NaN
    labels = np.argmax(proba, axis=1)  # softmax keeps the order: LocalModel.predict's classes
    accuracy = None
    if y is not None:
        ya = check_labels(model.classifier_info, y, len(labels))
        accuracy = float(np.mean(labels == ya))
    return {"model": _model_dict(model), "predictions": [int(v) for v in labels],
            "probabilities": proba.tolist(), "accuracy": accuracy, "n": int(len(labels))}


def format_lines(result: dict[str, Any], proba: bool) -> list[str]:
    """The lines ``fedsketch predict`` prints: header, one per sample, the accuracy (with labels)."""
    m = result["model"]
    lines = [f"model {m['key']} run {m['run']} architecture {m['architecture']} folder {m['folder']}"]
    for i, label in enumerate(result["predictions"]):
        row = f"{i} {label}"
        if proba:
            row += " " + " ".join(f"{p:.4f}" for p in result["probabilities"][i])
        lines.append(row)
    if result["accuracy"] is not None:
        lines.append(f"accuracy {result['accuracy']:.4f} on {result['n']} samples")
    return lines


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())


def run(args: argparse.Namespace) -> int:
    """``fedsketch predict``: 0, or 2 after one error line on stderr."""
    from .model_folder import ModelFolderError

    try:
        result = predict(args)
        lines = format_lines(result, args.proba)
        if not args.proba:
            del result["probabilities"]
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print("\n".join(lines))
    except (ModelFolderError, ValueError, OSError, RuntimeError) as e:  # RuntimeError: ONNX Runtime's own
        print(f"fedsketch predict: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0
