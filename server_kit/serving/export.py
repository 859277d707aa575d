"""What a run trained, as files an application can use: ``models/`` with one model folder per key.

::

    models -> .models-<when>/            a link, switched in one step when a newer export is whole
    .models-<when>/models.json           the run: id, strategy, architecture, round; each model's key,
                                         cluster, members and their samples, round, version, accuracy
                                         (mean over its devices, with their count) and every file's sha256
    .models-<when>/<key>/model.onnx      the classifier with the run's weights: ONNX Runtime alone runs it
    .models-<when>/<key>/weights.safetensors
    .models-<when>/<key>/model.json      the model folder's entry (edge_sdk.models.model_folder)
    .models-<when>/server-state/         what ``fedsketch-server --serve-models-from`` needs to place a new
                                         device and hand it its model with no training (a checkpoint)

Each export is written whole into its own folder, and the ``models`` link is
then switched to it (:func:`edge_sdk.models.model_folder.swap_link`): a reader sees
the previous export or the new one, never half of one. The export it
replaced is removed.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_sdk.models.artifacts import sha256_file
from edge_sdk.models.keep_offer import KeepOffer
from edge_sdk.models.model_checks import ModelInfo, state_spec
from edge_sdk.models.model_folder import ENTRY, ModelEntry, now_iso, swap_link, write_model_folder
from edge_sdk.training.evaluation import classifier_io

from ..strategies.base import Strategy
from .onnx_model import standalone_onnx

__all__ = ["MODELS_FORMAT", "SERVER_STATE", "ExportedRun", "export_models", "exported_accuracy", "read_models_json"]

log = logging.getLogger(__name__)

MODELS_FORMAT = "fedsketch-models/1"
SERVER_STATE = "server-state"


@dataclass(frozen=True)
class ExportedRun:
    """Where :func:`export_models` wrote, and what ``models.json`` says."""

    #: The ``models`` link and the folder it names.
    link: Path
    folder: Path
    manifest: dict[str, Any]


def _entry(offer: KeepOffer, *, run_id: str | None, strategy: str, architecture: str) -> ModelEntry:
    return ModelEntry(key=offer.key, architecture=architecture, **classifier_io(architecture), run=run_id,
                      strategy=strategy, cluster=offer.cluster, round=offer.round, version=offer.version,
                      members=offer.members, samples=offer.samples, server_accuracy=offer.accuracy,
                      server_evaluated=offer.evaluated)


def export_models(link: str | Path, strategy: Strategy, offers: Mapping[str, KeepOffer], *, run_id: str | None,
                  architecture: str, rnd: int, final: bool,
                  write_state: Callable[[Path], None] | None = None) -> ExportedRun:
    """Write the export of ``offers`` (:func:`~.offers.model_offers`) and switch ``link`` to it.

    ``final``: the accuracies come from the run's final evaluation (False: a checkpoint's export, which
    has none). ``write_state(folder)`` writes the server's state for serving (a checkpoint) into
    ``folder``. Raises OSError (a full or read-only disk) and ValueError (no template) as they come;
    the previous export stays whole then.
    """
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    old = link.resolve() if link.is_symlink() else None
    base = f".{link.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-r{rnd}"
    folder, n = link.parent / base, 1
    while folder.exists():
        n += 1
        folder = link.parent / f"{base}.{n}"
    try:
        manifest = _write(folder, strategy, offers, run_id=run_id, architecture=architecture, rnd=rnd,
                          final=final, write_state=write_state)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    swap_link(link, folder)
    if old is not None and old != folder.resolve():
        shutil.rmtree(old, ignore_errors=True)
    log.info("%d model(s) of round %d exported to %s (ONNX, safetensors, models.json%s)", len(offers), rnd, link,
             ", the server state" if write_state is not None else "")
    return ExportedRun(link, folder, manifest)


def _write(folder: Path, strategy: Strategy, offers: Mapping[str, KeepOffer], *, run_id: str | None,
           architecture: str, rnd: int, final: bool, write_state: Callable[[Path], None] | None) -> dict[str, Any]:
    folder.mkdir(parents=True)
    io = classifier_io(architecture)
    models = []
    for key, offer in sorted(offers.items()):
        weights = strategy.models[key]
        entry = _entry(offer, run_id=run_id, strategy=strategy.name, architecture=architecture)
        info = ModelInfo(architecture, tuple(io["input_shape"]), int(io["num_classes"]), state_spec(weights))
        done = write_model_folder(folder / key, entry, weights, onnx=standalone_onnx(entry, weights, info))
        files = {f"{key}/{name}": sha for name, sha in done.files.items()}
        files[f"{key}/{ENTRY}"] = sha256_file(folder / key / ENTRY)
        models.append({"key": key, "cluster": offer.cluster, "members": offer.members, "samples": offer.samples,
                       "round": offer.round, "version": offer.version, "accuracy": offer.accuracy,
                       "evaluated": offer.evaluated, "folder": key, "files": files})
    if write_state is not None:
        write_state(folder / SERVER_STATE)
    manifest = {
        "format": MODELS_FORMAT, "run": run_id, "strategy": strategy.name, "architecture": architecture,
        **{k: io[k] for k in ("input_name", "output_name", "num_classes")}, "input_shape": list(io["input_shape"]),
        "round": int(rnd), "accuracy_from": "final evaluation" if final else "none yet (a checkpoint's export)",
        "written_at": now_iso(), "server_state": SERVER_STATE if write_state is not None else None,
        "models": models,
    }
    (folder / "models.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_models_json(folder: str | Path) -> dict[str, Any]:
    """The ``models.json`` of an export (``REPORT_DIR/models``), checked for its format; ValueError if unfit."""
    path = Path(folder) / "models.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder}: no models.json (not a FedSketch models export)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MODELS_FORMAT:
        raise ValueError(f"{path}: not a FedSketch models export ({MODELS_FORMAT})")
    return manifest


def exported_accuracy(folder: str | Path) -> dict[str, tuple[float, int]]:
    """The accuracies an export's ``models.json`` recorded, by key (mean, devices); empty if it has none."""
    try:
        manifest = read_models_json(folder)
    except ValueError:
        return {}
    return {m["key"]: (float(m["accuracy"]), int(m["evaluated"])) for m in manifest["models"]
            if m.get("accuracy") is not None}
