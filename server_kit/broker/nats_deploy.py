"""The shipped three-node NATS configuration (``deploy/nats/``) on one machine: free ports, private folders, TLS off.

:class:`ShippedNatsCluster` runs ``deploy/nats/node<i>.conf`` (each includes
``cluster.conf``, which includes ``fedsketch-users.conf``) with every limit as
shipped (``max_payload``, ``max_connections``, JetStream stores, the MQTT
listener's ``max_ack_pending`` and ``ack_wait``); only what ties it to three
hosts changes: the listeners move to this cluster's free local ports, the routes
to those ports, the JetStream store and the log to the node's folder, and the
MQTT listener loses its TLS block (tests and benchmarks have no certificates).
The users file is the one ``deploy/nats/make_users.py`` writes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .nats import NatsCluster, NatsNode

__all__ = ["DEPLOY_NATS", "ShippedNatsCluster"]

#: The shipped NATS cluster's configuration (in a checkout; not installed with the package).
DEPLOY_NATS = Path(__file__).resolve().parents[2] / "deploy" / "nats"


class ShippedNatsCluster(NatsCluster):
    """Three nodes running the shipped configuration and the given users file (see the module docstring).

    Parameters
    ----------
    users_conf : str
        The text of ``fedsketch-users.conf`` (``deploy/nats/make_users.py --out``).
    deploy_dir : path, optional
        The folder holding ``cluster.conf`` and ``node1.conf`` .. ``node3.conf`` (default :data:`DEPLOY_NATS`).
    **kw
        :class:`NatsCluster` options (``login``, ``host``...); ``nodes`` is 3, as shipped.

    Raises
    ------
    ValueError
        When starting, if the shipped files no longer hold a line this adaptation rewrites (named).
    """

    def __init__(self, users_conf: str, *, deploy_dir: str | Path | None = None, **kw: Any) -> None:
        super().__init__(3, **kw)
        self.users_conf = users_conf
        self.deploy_dir = Path(deploy_dir) if deploy_dir is not None else DEPLOY_NATS

    def node_conf(self, node: NatsNode) -> str:
        d = node.directory
        text = (self.deploy_dir / "cluster.conf").read_text()
        routes = "\n".join(f"        {r}" for r in self.routes())
        for pattern, repl in [
            (r"^listen: 127\.0\.0\.1:4222$", f"listen: {self.host}:{node.client_port}"),
            (r"^http: 127\.0\.0\.1:8222$", f"http: {self.host}:{node.http_port}\nlog_file: \"{d}/nats.log\""),
            (r"store_dir: /var/lib/nats/fedsketch", f"store_dir: \"{d}/js\""),
            (r"listen: 0\.0\.0\.0:6222", f"listen: {self.host}:{node.cluster_port}"),
            (r"(?:^        nats-route://nats\d\.example\.org:6222\n)+", routes + "\n"),
            (r"listen: 0\.0\.0\.0:8883\n    tls \{\n[^}]*\}\n", f"listen: {self.host}:{node.mqtt_port}\n"),
        ]:
            text, n = re.subn(pattern, repl, text, flags=re.M)
            if n != 1:
                raise ValueError(f"{self.deploy_dir / 'cluster.conf'} no longer has {pattern!r}")
        (d / "cluster.conf").write_text(text)
        users = d / "fedsketch-users.conf"
        users.write_text(self.users_conf)
        users.chmod(0o600)
        node_file = self.deploy_dir / f"node{node.index + 1}.conf"
        node_text = node_file.read_text()
        match = re.search(r"^server_name: (\S+)$", node_text, flags=re.M)
        if match is None or "include cluster.conf" not in node_text:
            raise ValueError(f"{node_file} must name its server_name and include cluster.conf")
        node.name = match.group(1)
        return node_text
