"""``fedsketch-server --serve-models-from DIR``: the settings of the run that wrote an export."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..drivers.config import ServerConfig
from .export import SERVER_STATE, read_models_json

__all__ = ["export_settings"]


def export_settings(args: argparse.Namespace, strat: dict[str, Any], server_keys: Sequence[str]
                    ) -> tuple[Any, dict[str, Any], str]:
    """``--serve-models-from DIR``: the settings of the run that wrote the export, the options given overriding.

    The strategy is the export's (``--strategy`` must agree when given); the server state is read from
    ``DIR/server-state``. ValueError for a folder that is no export, or options that do not fit it.
    """
    folder = Path(args.serve_models_from)
    manifest = read_models_json(folder)
    if args.resume or args.serve_models or args.leave:
        raise ValueError("--serve-models-from serves an export: no --resume, --serve-models or --leave with it")
    name = manifest["strategy"]
    if args.strategy and args.strategy != name:
        raise ValueError(f"--strategy {args.strategy} differs from the export's strategy {name}")
    state_dir = folder / (manifest.get("server_state") or SERVER_STATE)
    try:
        state = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{state_dir}: the export's server state cannot be read ({e})") from None
    conf = dict(state.get("config") or {})
    known = {f.name for f in dataclasses.fields(ServerConfig)}
    conf = {k: v for k, v in conf.items() if k in known}
    for key in server_keys:  # the options given on the command line
        if getattr(args, key, None) is not None:
            conf[key] = getattr(args, key)
    conf["checkpoint_dir"] = str(state_dir)
    meta = state.get("strategy") or {}
    if "k" in meta:
        strat["k"] = meta["k"]
    return ServerConfig(**conf), strat, name
