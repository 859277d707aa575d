"""The shipped ``deploy/mosquitto.conf``, adapted to a private broker on one plain listener."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEPLOY_CONF", "adapt_deploy_conf"]

#: The shipped production configuration (in a checkout; not installed with the package).
DEPLOY_CONF = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto.conf"
#: Options of a TLS listener, dropped with it by :func:`adapt_deploy_conf`.
_TLS_OPTIONS = ("cafile", "capath", "certfile", "keyfile", "tls_version", "ciphers", "ciphers_tls1.3",
                "require_certificate", "use_identity_as_username", "use_subject_as_username", "crlfile",
                "dhparamfile", "psk_hint", "psk_file", "tls_engine", "tls_keyform")
#: Options :func:`adapt_deploy_conf` replaces with the private broker's own.
_REPLACED = ("password_file", "acl_file", "persistence_location", "log_dest", "allow_anonymous", "user")


def adapt_deploy_conf(text: str, *, port: int, host: str = "127.0.0.1", directory: str | os.PathLike[str],
                      password_file: str | None = None, acl_file: str | None = None) -> str:
    """``deploy/mosquitto.conf`` for a private broker on one plain listener, every limit kept.

    The devices' listener (the TLS one, with its own settings such as
    ``max_connections``) becomes a plain listener on ``host:port``, without
    its TLS options; the server's local listener is dropped (the server
    connects to the same port). The password file and ACL become the given
    ones (none: anonymous clients allowed, no ACL), the database and the log
    go to ``directory``. Everything else (queue, inflight, packet and
    connection limits, persistence, ``retain_available``...) stays as shipped.

    Raises
    ------
    ValueError
        When the text has no TLS listener to turn into the plain one.
    """
    out, listeners, in_tls = [], 0, False
    for line in text.splitlines():
        words = line.split()
        key = words[0] if words and not words[0].startswith("#") else ""
        if key == "listener":
            listeners += 1
            in_tls = len(words) == 2 or (len(words) > 2 and words[2] not in ("127.0.0.1", "localhost", "::1"))
            if in_tls:
                out.append(f"listener {int(port)} {host}")
            continue
        if key in _TLS_OPTIONS or key in _REPLACED:
            continue
        out.append(line)
    if listeners == 0 or not any(line.startswith(f"listener {int(port)} ") for line in out):
        raise ValueError("the configuration has no devices' (TLS) listener to turn into the private broker's")
    d = Path(directory)
    out += ["", "# -- written by server_kit.broker.adapt_deploy_conf --",
            f"allow_anonymous {'false' if password_file else 'true'}",
            f"persistence_location {d}/", f"log_dest file {d / 'mosquitto.log'}"]
    if password_file:
        out.append(f"password_file {password_file}")
    if acl_file:
        out.append(f"acl_file {acl_file}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        out.append("user root")  # otherwise mosquitto drops to 'mosquitto' and cannot read our files
    return "\n".join(out) + "\n"

