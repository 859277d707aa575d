"""``flwr run`` of a Flower app on a private local simulation: its own ``FLWR_HOME``, ports and SuperLink.

``flwr run`` starts a managed SuperLink in the background the first time and
keeps it (and its state) under ``~/.flwr``, on fixed ports. For tests and
benchmarks that must not touch a user's Flower setup, nor each other,
:func:`flwr_run` gives the run a fresh ``FLWR_HOME`` and free ports, and
stops that SuperLink afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..broker.ports import free_ports

__all__ = ["flwr_run"]


def _run_config(values: Mapping[str, Any]) -> str:
    """``--run-config`` text: strings quoted (TOML), numbers and booleans as they are."""
    def toml(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    return " ".join(f"{k}={toml(v)}" for k, v in values.items())


def flwr_run(app: str | os.PathLike[str], run_config: Mapping[str, Any], nodes: int, *,
             ray_address: str | None = None, log: str | os.PathLike[str] | None = None,
             timeout: float = 3600) -> float:
    """Run ``app`` with ``flwr run --stream`` on ``nodes`` virtual SuperNodes; the wall seconds.

    Parameters
    ----------
    app : path
        The Flower app's folder (its ``pyproject.toml``).
    run_config : mapping
        ``--run-config`` overrides (keys the app declares).
    nodes : int
        Virtual SuperNodes of the simulation.
    ray_address : str, optional
        A running Ray cluster for the simulation (``RAY_ADDRESS``), instead of a private one.
    log : path, optional
        Where ``flwr run``'s output goes (default: discarded).

    Raises
    ------
    subprocess.CalledProcessError
        If ``flwr run`` fails (its output is in ``log``).
    """
    home = Path(tempfile.mkdtemp(prefix="fedsketch-flwr-"))
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    http, control = free_ports(2)
    bindir = Path(sys.executable).parent
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    cmd = [str(bindir / "flwr"), "run", str(app), "local", "--stream",
           "--federation-config",
           f"num-supernodes={int(nodes)} client-resources-num-cpus=1", "--run-config", _run_config(run_config)]
    t0 = time.perf_counter()
    try:
        with open(log or os.devnull, "w") as out:
            subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout)
        return time.perf_counter() - t0
    finally:
        _stop_superlink(http)


def _stop_superlink(port: int) -> None:
    """Stop the SuperLink ``flwr run`` started on ``port``."""
    out = subprocess.run(["pgrep", "-f", f"flower-superlink.*--port {port}"], capture_output=True, text=True)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass
