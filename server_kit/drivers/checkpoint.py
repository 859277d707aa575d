"""A server run's checkpoint folder: written after every round, read back by ``--resume``.

The folder holds ``models.safetensors`` (the strategy's tensors),
``state.json`` (the round, the strategy's other state, the history, the
clients, their sketches, the configuration, the models of the run; in a
run that follows drift, the fresh sketches not yet acted on) and,
after federated pre-training, ``encoder/`` (the federated encoder and its
manifest). Each file is written to a temporary name first and then renamed,
so a server killed while writing leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.sketch import Sketch

from ..strategies.base import ClientInfo, Strategy
from .config import ServerConfig

__all__ = ["Checkpoint", "read_checkpoint", "read_encoder", "write_checkpoint"]


def write_checkpoint(directory: str | Path, rnd: int, strategy: Strategy, *, history: list[dict[str, Any]],
                     timings: Mapping[str, float], clients: Mapping[str, ClientInfo], sketches: Mapping[str, Any],
                     config: ServerConfig, encoder: str | None, architecture: str | None, latent_dim: int | None,
                     pretrain_history: list[dict[str, Any]], fresh: Mapping[str, Sketch] | None = None,
                     pace: Mapping[str, Any] | None = None, run_id: str | None = None) -> None:
    """Write the state after round ``rnd`` to ``directory`` (created if missing); see the module docstring.

    ``fresh``: the sketches a run that follows drift got during training and has not handed to its strategy
    yet (:mod:`~server_kit.drivers.resketch`); None (a run that does not follow drift) writes no such key.
    ``pace``: the run's memory of its devices' pace (:meth:`server_kit.rounds.pace.Pace.state`).
    ``run_id``: the run's id, which a resumed run announces again (its devices keep what the run gave them).
    """
    from safetensors.numpy import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    meta, tensors = strategy.state()
    tmp = path / "models.safetensors.tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path / "models.safetensors")
    state = {
        "round": rnd, "strategy": meta, "history": history, "timings": timings,
        "clients": {c: asdict(info) for c, info in clients.items()},
        "sketches": _sketches_json(sketches),
        "config": asdict(config),
        "encoder": encoder, "architecture": architecture, "latent_dim": latent_dim,
        "pretrain_history": pretrain_history, "pace": dict(pace or {}), "run_id": run_id,
    }
    if fresh is not None:
        state["fresh_sketches"] = _sketches_json(fresh)
    tmp = path / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1, default=list))
    os.replace(tmp, path / "state.json")


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`read_checkpoint` found (absent fields of an older checkpoint: empty, or None)."""

    path: Path
    round: int
    strategy: Any
    tensors: dict[str, np.ndarray]
    clients: dict[str, ClientInfo]
    sketches: dict[str, Sketch]
    history: list[dict[str, Any]]
    timings: dict[str, float]
    pretrain_history: list[dict[str, Any]]
    encoder: str | None
    architecture: str | None
    latent_dim: int | None
    #: Fresh sketches of a run that follows drift, not yet acted on.
    fresh: dict[str, Sketch] = field(default_factory=dict)
    #: The run's memory of its devices' pace (training times, benched devices...).
    pace: dict[str, Any] = field(default_factory=dict)
    #: The run's id (None in a checkpoint of an older version).
    run_id: str | None = None


def _sketches_json(sketches: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Each sketch as ``[bits in hex, num_classes, latent_dim]`` (float summaries are not kept)."""
    return {c: [s.bits.hex(), s.num_classes, s.latent_dim] for c, s in sketches.items() if isinstance(s, Sketch)}


def _sketches_read(rows: Mapping[str, Any]) -> dict[str, Sketch]:
    """What :func:`_sketches_json` wrote."""
    return {c: Sketch(bytes.fromhex(hx), n, lat) for c, (hx, n, lat) in rows.items()}


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """The checkpoint in ``directory``; FileNotFoundError if there is none."""
    from safetensors.numpy import load_file

    path = Path(directory)
    state_file = path / "state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {path} (state.json missing)")
    state = json.loads(state_file.read_text())
    tensors = load_file(str(path / "models.safetensors"))
    infos = {c: ClientInfo(**{k: (tuple(v) if k == "capabilities" else v) for k, v in i.items()})
             for c, i in state["clients"].items()}
    return Checkpoint(
        path=path, round=int(state["round"]), strategy=state["strategy"], tensors=tensors, clients=infos,
        sketches=_sketches_read(state.get("sketches", {})), fresh=_sketches_read(state.get("fresh_sketches", {})),
        history=list(state.get("history", [])), timings=dict(state.get("timings", {})),
        pretrain_history=list(state.get("pretrain_history", [])), encoder=state.get("encoder"),
        architecture=state.get("architecture"), pace=dict(state.get("pace") or {}), run_id=state.get("run_id"),
        latent_dim=int(state["latent_dim"]) if state.get("latent_dim") is not None else None)


def read_encoder(directory: str | Path, name: str | None) -> tuple[dict[str, Any], bytes] | None:
    """The federated encoder ``name`` of a checkpoint, as it is delivered (meta, .onnx bytes); None if none."""
    enc_dir = Path(directory) / "encoder"
    if not (enc_dir / "manifest.json").is_file():
        return None
    from edge_sdk.models.artifacts import load_manifest

    spec = load_manifest(enc_dir)[name]
    raw = json.loads((enc_dir / "manifest.json").read_text())["artifacts"][name]
    return ({"key": "encoder", "name": name, "sha256": spec.sha256, "entry": raw}, (enc_dir / spec.file).read_bytes())
