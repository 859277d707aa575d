"""One ``nats-server`` of a cluster: finding the binary, its version, its node (ports, folder, process), the MQTT probe.

:class:`~server_kit.broker.nats.NatsCluster` starts and checks the nodes; this
module holds what one node is and the one-packet MQTT 3.1.1 handshake
(:func:`mqtt_connack`) the cluster waits on before it calls a node ready.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from .ports import find_binary
from .process import BrokerProcess

__all__ = ["NatsNode", "PortTaken", "find_nats_server", "mqtt_connack", "nats_server_version"]


class PortTaken(RuntimeError):
    """A node could not listen: a port chosen free was taken before the node bound it."""

def find_nats_server() -> str | None:
    """Path of the ``nats-server`` binary: on PATH, else ``/usr/sbin/nats-server``, else None."""
    return find_binary("nats-server")


def nats_server_version(binary: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``nats-server --version`` (``nats-server: v2.9.10`` gives ``(2, 9, 10)``)."""
    binary = binary or find_nats_server()
    if binary is None:
        raise FileNotFoundError("nats-server is not installed (not on PATH nor at /usr/sbin/nats-server)")
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    m = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    if m is None:
        raise RuntimeError(f"cannot read a version in {binary} --version: {(out.stdout + out.stderr).strip()!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))

def _utf8(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("!H", len(raw)) + raw


def mqtt_connack(host: str, port: int, client_id: str, *, username: str | None = None,
                 password: str | None = None, timeout: float = 10.0) -> int:
    """Send one MQTT 3.1.1 CONNECT (clean session) and return the CONNACK's code (0: accepted), then DISCONNECT.

    What :meth:`NatsCluster.start` waits for: NATS answers once it can keep the client's session in
    JetStream (the first MQTT client of a node sets up its session manager there).
    """
    flags = 0x02 | (0x80 if username is not None else 0) | (0x40 if password is not None else 0)
    body = _utf8("MQTT") + bytes([4, flags]) + struct.pack("!H", 10) + _utf8(client_id)
    body += (_utf8(username) if username is not None else b"") + (_utf8(password) if password is not None else b"")
    length, n = b"", len(body)
    while True:
        byte, n = n & 0x7F, n >> 7
        length += bytes([byte | (0x80 if n else 0)])
        if not n:
            break
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(b"\x10" + length + body)
        answer = b""
        while len(answer) < 4:
            chunk = sock.recv(4 - len(answer))
            if not chunk:
                raise ConnectionError(f"{host}:{port} closed the connection before its CONNACK")
            answer += chunk
        if answer[0] != 0x20:
            raise ConnectionError(f"{host}:{port} answered a CONNECT with packet type {answer[0] >> 4}")
        if answer[3] == 0:
            sock.sendall(b"\xe0\x00")
        return answer[3]


class NatsNode:
    """One ``nats-server`` of a :class:`NatsCluster`: its ports, folder and process."""

    def __init__(self, index: int, name: str, host: str, directory: Path, *, client_port: int, cluster_port: int,
                 mqtt_port: int, http_port: int) -> None:
        self.index = index
        self.name = name
        self.host = host
        self.directory = directory
        self.client_port = client_port
        self.cluster_port = cluster_port
        self.mqtt_port = mqtt_port
        self.http_port = http_port
        self._process = BrokerProcess(f"nats-server {name}")

    def __repr__(self) -> str:
        return f"NatsNode({self.index}, {self.name!r}, mqtt={self.mqtt_url!r}, {'running' if self.running else 'stopped'})"

    @property
    def mqtt_url(self) -> str:
        """``mqtt://host:port`` of this node's MQTT listener."""
        return f"mqtt://{self.host}:{self.mqtt_port}"

    @property
    def conf(self) -> Path:
        """This node's configuration file."""
        return self.directory / "nats.conf"

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process.running

    @property
    def pid(self) -> int | None:
        """Process id (None when stopped)."""
        return self._process.pid

    def log_text(self) -> str:
        """This node's log so far (for debugging failed tests)."""
        path = self.directory / "nats.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def monitor(self, endpoint: str, timeout: float = 1.0) -> dict[str, Any] | None:
        """The JSON of a monitoring endpoint (``jsz``, ``routez``, ``healthz``...), or None if it does not answer."""
        url = f"http://{self.host}:{self.http_port}/{endpoint}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (a local http URL we built)
                return json.loads(r.read().decode())
        except (OSError, ValueError):
            return None

    def _spawn(self, binary: str) -> None:
        self._process.spawn([binary, "-c", str(self.conf)], self)

    def _stderr(self) -> str:
        return self._process.stderr_text()

    def _stop(self, timeout: float, sig: int = signal.SIGTERM) -> None:
        self._process.stop(timeout, sig)
