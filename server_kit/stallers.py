"""Devices that would hold a round open, for the tests and ``benchmarks/robustness.py``.

* :func:`malformed_updates`: a train handler whose every update is refused:
  in odd rounds a meta field of ``1e400`` (refused by the transport before
  it is decoded), in even rounds a body that is no tensors (refused by the
  server's checks);
* :func:`claims_forever`: a train handler that says "training round r" every
  ``progress_interval_s`` and never sends an update (until ``release``);
* :class:`SlowWorker`: an honest device whose training starts ``sleep_s``
  late (a stalled SD card), longer than the round's deadline.

A device plays one of the first two with its handler table
(``EdgeClient(..., handlers={**HANDLERS, Op.TRAIN: handler})``). Each takes
a ``release`` event (set it after the last round): from then on it answers
at once, so that the final evaluation hears from it.
:func:`start_devices` starts a fleet with the three of them (``c00``,
``c01``, ``c02``) or without, and :func:`run_and_release` runs a server over
it and lets them go.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from edge_sdk.client import EdgeClient
from edge_sdk.client.commands import HANDLERS, Command, DeviceContext, Handler, report_progress
from edge_sdk.client.state import DeviceState
from edge_sdk.protocol import MAGIC, PROTOCOL_VERSION, Kind, Message
from edge_sdk.protocol.commands import Op
from edge_sdk.tasks import Task, Update
from edge_sdk.worker import LocalWorker

__all__ = ["STALLERS", "SlowWorker", "claims_forever", "malformed_updates", "raw_update", "run_and_release",
           "start_devices"]

#: Which device plays which staller in :func:`start_devices`.
STALLERS = {"c00": "malformed updates", "c01": "claims progress forever", "c02": "starts training late"}


def raw_update(federation: str, cid: str, meta_json: str, rnd: int) -> bytes:
    """An UPDATE envelope with its meta exactly as written (no encoder writes ``1e400``), no body."""
    meta = meta_json.encode()
    head = struct.pack(">2sBBBIHI", MAGIC, PROTOCOL_VERSION, int(Kind.UPDATE), 0, rnd, len(meta), 0)
    return head + bytes((len(federation),)) + federation.encode() + bytes((len(cid),)) + cid.encode() + meta


def malformed_updates(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """A train handler whose every update is refused (see the module docstring)."""
    link = ctx.link
    r, key = cmd.fields["round"], cmd.fields["models"][0]
    topic = link.topics.update(link.cid)
    if r % 2:
        raw = raw_update(link.federation, link.cid, f'{{"round":{r},"model_key":"{key}","n_samples":1e400}}', r)
        if hasattr(link.transport, "publish_raw"):  # the in-memory broker
            link.transport.publish_raw(topic, raw)
        else:  # MQTT: straight through paho, as a device with its own credentials could
            link.transport._client.publish(topic, raw, qos=1)
    else:
        meta = {"round": r, "model_key": key, "n_samples": 50, "loss": 0.1, "metrics": {}}
        link.transport.publish(topic, Message(Kind.UPDATE, link.federation, link.cid, r, meta, b"\x01" * 64))


def claims_forever(release: threading.Event) -> Handler:
    """A train handler that says it trains and never sends an update, until ``release``."""
    def train(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
        done = threading.Event()
        beat = threading.Thread(target=report_progress, args=(ctx, cmd.fields["round"], done), daemon=True,
                                name=f"{ctx.link.cid}-claims")
        beat.start()
        release.wait()
        done.set()
    return train


class SlowWorker(LocalWorker):
    """An honest device that starts training ``sleep_s`` late (until ``release``)."""

    sleep_s = 60.0

    def __init__(self, *args: Any, release: threading.Event, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.release = release

    def fit(self, task: Task, **kw: Any) -> Update:
        self.release.wait(self.sleep_s)
        return super().fit(task, **kw)


def start_devices(clients: Sequence[Any], transport: Callable[[str], Any], *, architecture: str,
                  release: threading.Event, stallers: bool, seed: int = 0, max_idle_s: float = 300.0
                  ) -> list[threading.Thread]:
    """One :class:`EdgeClient` thread per client (``cid``, ``x_train``, ...); with ``stallers``, :data:`STALLERS`.

    ``transport(cid)`` makes a device's transport; device ``i`` is seeded ``seed * 1000 + i`` and reports
    progress every second.
    """
    trains: dict[str, Handler] = {"c00": malformed_updates, "c01": claims_forever(release)} if stallers else {}
    threads = []
    for i, c in enumerate(clients):
        data = (c.cid, c.x_train, c.y_train, c.x_test, c.y_test)
        s = seed * 1000 + i
        worker = (SlowWorker(*data, architecture=architecture, seed=s, release=release)
                  if stallers and c.cid == "c02" else LocalWorker(*data, architecture=architecture, seed=s))
        t = transport(c.cid)
        handlers = {**HANDLERS, Op.TRAIN: trains[c.cid]} if c.cid in trains else None
        edge = EdgeClient(t, worker, federation=t.federation, seed=s, model_timeout_s=120, progress_interval_s=1.0,
                          handlers=handlers)
        th = threading.Thread(target=edge.run, kwargs={"max_idle_s": max_idle_s}, daemon=True, name=c.cid)
        th.start()
        threads.append(th)
    return threads


def run_and_release(orchestrator: Any, release: threading.Event, threads: Sequence[threading.Thread], *,
                    join_s: float = 60.0) -> Any:
    """``orchestrator.run()``; then (whatever happens) the stallers let go, the server's transport closed and
    the devices waited for (``join_s`` each). Set ``release`` after the last round yourself (``on_round``), so
    that the final evaluation hears from them."""
    try:
        return orchestrator.run()
    finally:
        release.set()
        orchestrator.transport.close()
        for th in threads:
            th.join(timeout=join_s)
