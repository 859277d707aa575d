"""The devices a server knows: admitted or refused, online or not, and whether each can train.

:class:`Fleet` admits a device that says hello (a welcome saying what to
use) or refuses it (with the reason, which makes it exit), keeps the set of
online admitted devices in step with their status messages (in O(1), so
that nothing scans the fleet per message), and tells its listener (the
driver) of every change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from edge_sdk.health import DeviceHealth
from edge_sdk.install import install_hint
from edge_sdk.protocol.commands import Op

from ..strategies.base import ClientInfo
from .link import ServerLink
from .models import RunModels

__all__ = ["ADMISSIONS_LOGGED", "ClientState", "Fleet"]

#: Admissions logged one by one at INFO while a fleet registers; the rest at DEBUG.
ADMISSIONS_LOGGED = 20

log = logging.getLogger(__name__)


@dataclass
class ClientState:
    """What the server knows of one admitted device."""

    info: ClientInfo
    online: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    #: Whether it can train (torch): a device that cannot is never tasked to.
    trains: bool = True
    #: The round it last said it is training, and when.
    working: tuple[int, float] | None = None
    #: The round whose update it last said it sent, and when (a lost one is asked for again).
    sent: tuple[int, float] | None = None
    #: The round whose large update it last announced, and its size (asked for when its receiver has room).
    ready: tuple[int, int] | None = None
    #: Its latest health (its hello's, then each status that carries one), None while it said none.
    health: DeviceHealth | None = None


@dataclass(frozen=True)
class DeviceSpeed:
    """A device's own benchmark, as its hello said it (``fedsketch bench``, then ``fedsketch-client --bench``)."""

    #: Its CPU, as the device names it (``Raspberry Pi 4 Model B Rev 1.1``).
    cpu: str | None
    #: Its figures: ``sketch_ms``, ``epoch_ms``, ``epoch_over_sketch``, ``cores``, ``mem_mb`` (those it measured).
    figures: dict[str, float]

    @classmethod
    def from_hello(cls, hello: Mapping[str, Any]) -> DeviceSpeed | None:
        """The speed a (schema-checked) hello carries, or None when it carries none."""
        if "bench" not in hello and "cpu" not in hello:
            return None
        return cls(hello.get("cpu"), dict(hello.get("bench") or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, **self.figures}


class Fleet:
    """The devices the server knows (see the module docstring).

    Parameters
    ----------
    link : ServerLink
        Where the welcome and refused commands go.
    num_classes : int
        The classes of the federation (a device that says it has more is refused).
    on_online : callable
        ``on_online(cid, online)``: called after every change of the online set.
    """

    def __init__(self, link: ServerLink, num_classes: int,
                 on_online: Callable[[str, bool], None] = lambda cid, online: None) -> None:
        self.link = link
        self.num_classes = num_classes
        self.on_online = on_online
        #: Admitted devices.
        self.clients: dict[str, ClientState] = {}
        #: Online admitted clients (kept by :meth:`set_online`; counted without a scan).
        self.online_ids: set[str] = set()
        #: Hellos of devices not yet admitted nor refused (while the models are not chosen).
        self.pending: dict[str, dict[str, Any]] = {}
        #: Devices refused at registration, with the reason they were told.
        self.refused: dict[str, str] = {}
        #: Each device's public key for secure aggregation (hex), as its last hello said.
        self.secure_keys: dict[str, str] = {}
        #: Admitted devices left out of training, with the reason.
        self.not_training: dict[str, str] = {}
        #: The round in which each device that went offline was last seen online.
        self.went_offline: dict[str, int] = {}
        #: Devices not tasked again in this run (their updates were refused round after round), with the reason.
        self.benched: dict[str, str] = {}
        #: Each device's own benchmark, from its hello (devices that sent one).
        self.speeds: dict[str, DeviceSpeed] = {}

    def online(self) -> list[str]:
        """Online admitted clients."""
        return sorted(c for c, s in self.clients.items() if s.online)

    def trainable(self) -> list[str]:
        """Online admitted clients that can train and are not benched (a scan: once per phase, never per message)."""
        return sorted(c for c, s in self.clients.items() if s.online and s.trains and c not in self.benched)

    def bench(self, cid: str, reason: str) -> None:
        """Task ``cid`` no more in this run (it still sketches; the final evaluation neither asks nor waits for it)."""
        self.benched[cid] = reason

    def set_online(self, cid: str, online: bool) -> None:
        """Keep the online set in step, then tell the listener (O(1))."""
        if online:
            self.online_ids.add(cid)
        else:
            self.online_ids.discard(cid)
        self.on_online(cid, online)

    def on_status(self, cid: str, state: ClientState, meta: Mapping[str, Any], rnd: int) -> None:
        """A device's status: online or offline (``rnd``: the round it went offline in), whether it trains, and its
        health (a status without one keeps the last)."""
        online = meta["state"] != "offline"
        if state.online and not online:
            log.info("client %s is offline", cid)
            self.went_offline[cid] = rnd
        state.online = online
        self.set_online(cid, online)
        if "working" in meta:
            state.working = (meta["working"], time.monotonic())
        if "sent" in meta:
            state.sent = (meta["sent"], time.monotonic())
        if "ready" in meta:
            state.ready = (meta["ready"], meta.get("size", 0))
        if "health" in meta:
            state.health = DeviceHealth.from_meta(meta["health"])

    def restore(self, infos: Mapping[str, ClientInfo]) -> None:
        """The devices of a checkpoint, all offline until they say hello again."""
        self.clients = {c: ClientState(info, online=False, trains="train-torch" in info.capabilities)
                        for c, info in infos.items()}
        self.online_ids = set()

    def admit(self, cid: str, hello: Mapping[str, Any], models: RunModels, *, registering: bool) -> bool:
        """Admit a device (welcome: what to use) or refuse it (with the reason, which makes it exit)."""
        from ..admission import can_train, refusal

        reason = refusal(hello, input_size=models.input_size, num_classes=self.num_classes)
        if reason is not None:
            self.refused[cid] = reason
            self.clients.pop(cid, None)
            self.set_online(cid, False)
            log.warning("refused client %s: %s", cid, reason)
            self.link.command(cid, Op.REFUSED, reason=reason)
            return False
        self.refused.pop(cid, None)
        known = self.clients.get(cid)
        n = hello["n_samples"]
        if known is not None and n != known.info.n_samples:
            # the sample count weighs this device's updates: it is fixed at registration
            log.warning("client %s says hello with %d samples, registered with %d: keeping %d",
                        cid, n, known.info.n_samples, known.info.n_samples)
            n = known.info.n_samples
        trains = can_train(hello)
        speed = DeviceSpeed.from_hello(hello)
        if speed is not None:
            self.speeds[cid] = speed
        info = ClientInfo(cid, n, hello["classes_present"], tuple(hello["capabilities"]))
        health = DeviceHealth.from_meta(hello["health"]) if "health" in hello else (
            None if known is None else known.health)
        self.clients[cid] = ClientState(info, trains=trains, health=health)
        self.set_online(cid, True)
        why = None if trains else f"no torch on the device ({install_hint('train')})"
        if why:
            self.not_training[cid] = why
        else:
            self.not_training.pop(cid, None)
        welcome: dict[str, Any] = {"num_classes": self.num_classes, "train": trains, **models.welcome()}
        if why:
            welcome["reason"] = why
        if self.link.run_id is not None:
            welcome["run"] = self.link.run_id
        self.link.command(cid, Op.WELCOME, **welcome)
        if known is None:
            self._log_admission(cid, info, trains, why, registering)
        elif not known.online:
            log.info("client %s is back", cid)
        return True

    def _log_admission(self, cid: str, info: ClientInfo, trains: bool, why: str | None, registering: bool) -> None:
        # a fleet registering at once: the first few, then DEBUG (the count closes registration)
        loud = not registering or len(self.clients) <= ADMISSIONS_LOGGED or not trains
        speed = self.speeds.get(cid)
        said = "" if speed is None else "; its bench: " + ", ".join(
            [speed.cpu or "CPU not said"] + [f"{k} {v:g}" for k, v in speed.figures.items()])
        log.log(logging.INFO if loud else logging.DEBUG, "client %s admitted (%d samples, %d classes%s)%s", cid,
                info.n_samples, info.classes_present, "" if trains else f"; sketches and evaluates, never trains: {why}",
                said)
        if registering and len(self.clients) == ADMISSIONS_LOGGED + 1:
            log.info("more clients are registering: each one logged at DEBUG (-v), the count when "
                     "registration closes")
