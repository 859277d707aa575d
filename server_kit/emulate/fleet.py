"""The fleet: devices in this process or spread over child processes, and what crosses to them.

:class:`EmulatedFleet` runs one :class:`~server_kit.emulate.shard.Shard` in
this process (``processes=0``), or one per spawned child process; a child
gets its devices' data as numpy arrays in its process arguments and answers
the parent in JSON over a pipe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..cores import Role, limit_threads, plan
from ..data.partition import ClientData
from .shard import FleetSettings, Shard, sum_into

__all__ = ["EmulatedFleet"]

log = logging.getLogger(__name__)


# -- child processes ---------------------------------------------------------------------


def _pack(clients: Sequence[ClientData]) -> dict[str, Any]:
    """Devices' data as a few arrays (what crosses to a child process)."""
    n_train = np.array([len(c.y_train) for c in clients], dtype=np.int64)
    n_test = np.array([len(c.y_test) for c in clients], dtype=np.int64)
    return {
        "cids": [c.cid for c in clients], "groups": [int(c.group) for c in clients],
        "n_train": n_train, "n_test": n_test,
        "x_train": np.concatenate([c.x_train for c in clients]).astype(np.float32),
        "y_train": np.concatenate([c.y_train for c in clients]).astype(np.int64),
        "x_test": np.concatenate([c.x_test for c in clients]).astype(np.float32),
        "y_test": np.concatenate([c.y_test for c in clients]).astype(np.int64),
    }


def _unpack(p: Mapping[str, Any]) -> list[ClientData]:
    out = []
    a = b = 0
    for cid, g, n, m in zip(p["cids"], p["groups"], p["n_train"], p["n_test"]):
        out.append(ClientData(cid, p["x_train"][a:a + n], p["y_train"][a:a + n], p["x_test"][b:b + m],
                              p["y_test"][b:b + m], int(g)))
        a, b = a + int(n), b + int(m)
    return out


def _shard_main(conn: Any, settings: dict[str, Any], packed: dict[str, Any], passwords: dict[str, str]) -> None:
    """A child process: run one shard, answer the parent's requests ("snapshot", "totals", "close") in JSON."""
    s = FleetSettings(**settings)
    logging.basicConfig(level=logging.WARNING if s.quiet else logging.INFO,
                        format="%(asctime)s emulator %(levelname)s %(name)s: %(message)s")
    try:
        import torch  # noqa: F401  (loaded before its pool is sized)
    except ImportError:
        pass
    limit_threads(plan(Role.EMULATOR))
    shard = Shard(s, _unpack(packed), passwords)
    try:
        shard.start()
        conn.send_bytes(json.dumps({"ok": True, "snapshot": shard.snapshot()}).encode())
    except Exception as e:
        conn.send_bytes(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode())
        shard.close()
        return
    while True:
        try:
            req = conn.recv_bytes().decode()
        except (EOFError, OSError):
            req = "close"
        if req == "close":
            final = shard.snapshot(totals=True)
            shard.close()
            try:
                conn.send_bytes(json.dumps(final).encode())
            except (OSError, ValueError):
                pass
            return
        conn.send_bytes(json.dumps(shard.snapshot(totals=req == "totals")).encode())


class EmulatedFleet:
    """Real devices in this process or a few child processes.

    Parameters
    ----------
    broker_url : str
        ``mqtt://host:port`` of the broker, or a comma-separated list (a NATS
        cluster's nodes, :attr:`NatsCluster.url`): the devices of a process
        then start at each broker in turn, and each fails over round the others.
    clients : sequence of ClientData
        One device each (:func:`fleet_partition`, or any partition).
    passwords : mapping, optional
        Device id -> broker password (the device logs in with its id as user
        name); None: no credentials (an anonymous broker).
    processes : int
        0: the devices run in this process; n >= 1: in n child processes
        (spawned), devices dealt out in turn.
    **settings
        :class:`FleetSettings` fields: ``federation``, ``root``, ``loops``,
        ``workers``, ``steppers``, ``hello_jitter_s``, ``model_timeout_s``,
        ``connect_window``, ``seed``...

    :meth:`start` returns once every device is connected and subscribed (its
    hello scheduled); :meth:`close` disconnects them cleanly.
    """

    def __init__(self, broker_url: str, clients: Sequence[ClientData], *,
                 passwords: Mapping[str, str] | None = None, processes: int = 0, **settings: Any) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ValueError(f"processes must be a non-negative integer, got {processes!r}")
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(FleetSettings)})
        if unknown:
            raise TypeError(f"unknown settings {unknown}; known: "
                            f"{sorted(f.name for f in dataclasses.fields(FleetSettings))}")
        self.settings = FleetSettings(broker_url=broker_url, **settings)
        self.clients = list(clients)
        if not self.clients:
            raise ValueError("an emulated fleet needs at least one device")
        self.passwords = dict(passwords) if passwords is not None else None
        self.processes = min(processes, len(self.clients))
        self._shard: Shard | None = None
        self._procs: list[tuple[Any, Any]] = []
        self._final: list[dict[str, Any]] = []
        self.start_s: float | None = None

    def __repr__(self) -> str:
        return (f"EmulatedFleet({len(self.clients)} devices, processes={self.processes}, "
                f"broker={self.settings.broker_url!r})")

    def start(self) -> EmulatedFleet:
        """Create and connect every device; returns when all are connected and subscribed."""
        t0 = time.monotonic()
        if self.processes == 0:
            self._shard = Shard(self.settings, self.clients, self.passwords)
            try:
                self._shard.start()
            except BaseException:
                self._shard.close()
                raise
        else:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            settings = dataclasses.asdict(self.settings)
            for k in range(self.processes):
                part = self.clients[k::self.processes]
                pw = {c.cid: self.passwords[c.cid] for c in part} if self.passwords is not None else {}
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_shard_main, args=(child, settings, _pack(part), pw),
                                   name=f"fedsketch-emulator-{k}", daemon=True)
                proc.start()
                child.close()
                self._procs.append((proc, parent))
            errors = []
            for proc, conn in self._procs:
                if not conn.poll(self.settings.connect_timeout_s + 120):
                    errors.append(f"{proc.name}: no answer")
                    continue
                answer = json.loads(conn.recv_bytes().decode())
                if not answer.get("ok"):
                    errors.append(f"{proc.name}: {answer.get('error')}")
            if errors:
                self.close()
                raise RuntimeError("emulator processes failed to start: " + "; ".join(errors))
        self.start_s = time.monotonic() - t0
        return self

    @property
    def pids(self) -> list[int]:
        """Process ids running the devices (this process's own with ``processes=0``)."""
        if self._procs:
            return [proc.pid for proc, _ in self._procs if proc.pid is not None]
        return [os.getpid()]

    def _ask(self, req: str) -> list[dict[str, Any]]:
        out = []
        for proc, conn in self._procs:
            try:
                conn.send_bytes(req.encode())
                if conn.poll(60):
                    out.append(json.loads(conn.recv_bytes().decode()))
            except (OSError, EOFError, ValueError):
                log.warning("emulator process %s does not answer", proc.name)
        return out

    def snapshot(self, totals: bool = False) -> dict[str, Any]:
        """Counts over every device: connected, done, exit codes, commands handled per op (see :class:`Shard`)."""
        if self._shard is not None:
            return self._shard.snapshot(totals)
        parts = self._final or self._ask("totals" if totals else "snapshot")
        out: dict[str, Any] = {}
        for p in parts:
            sum_into(out, p)
        return out

    def wait_connected(self, timeout: float = 60.0) -> bool:
        """Wait until every device is connected; returns whether they are."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            if snap.get("connected", 0) >= len(self.clients):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def wait_done(self, timeout: float = 60.0) -> bool:
        """Wait until every device stopped (the server said stop, or refused it)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.snapshot().get("done", 0) >= len(self.clients):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def close(self, timeout: float = 30.0) -> dict[str, Any]:
        """Disconnect every device cleanly and end the processes; returns the final counts with traffic."""
        if self._shard is not None:
            final = self._shard.snapshot(totals=True)
            self._shard.close()
            self._shard = None
            self._final = [final]
            return final
        if self._procs and not self._final:
            self._final = self._ask("close")
            for proc, conn in self._procs:
                proc.join(timeout)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
                conn.close()
            self._procs = []
        out: dict[str, Any] = {}
        for p in self._final:
            sum_into(out, p)
        return out

    def __enter__(self) -> EmulatedFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
