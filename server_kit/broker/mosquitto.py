"""Mosquitto in a subprocess: a private broker on a free local port, with its configuration, passwords and ACL.

:class:`MosquittoBroker` writes a configuration (listener, persistence,
message limits, password file, ACL) into a temporary folder and runs
``mosquitto -c`` on it; it is the broker of the integration tests and the one
the ``deploy/`` configuration targets (:mod:`~server_kit.broker.deploy_conf`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from .deploy_conf import DEPLOY_CONF, adapt_deploy_conf
from .ports import find_binary, free_port, wait_port
from .process import BrokerProcess

__all__ = ["MosquittoBroker", "find_mosquitto"]

log = logging.getLogger(__name__)

def find_mosquitto() -> str | None:
    """Path of the ``mosquitto`` binary: on PATH, else ``/usr/sbin/mosquitto``, else None."""
    return find_binary("mosquitto")


def _find_passwd_tool(mosquitto: str) -> str | None:
    found = shutil.which("mosquitto_passwd")
    if found:
        return found
    for folder in (Path(mosquitto).parent, Path("/usr/bin"), Path("/usr/sbin")):
        candidate = folder / "mosquitto_passwd"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


class MosquittoBroker:
    """A private Mosquitto on a free local port.

    Parameters
    ----------
    port : int, optional
        Port to listen on (default: a free one, kept across :meth:`restart`).
    host : str
        Address to listen on.
    acl : str, optional
        Contents of an ACL file (``user``/``topic``/``pattern`` lines).
    passwords : dict of str to str, optional
        User names and passwords, hashed into a password file with
        ``mosquitto_passwd``.
    allow_anonymous : bool, optional
        Default: True without ``passwords``, False with them.
    message_size_limit, max_packet_size : int, optional
        Mosquitto's limits on a message's payload and on a whole packet.
    persistence : bool
        Keep sessions and queued messages on disk, so they survive a
        :meth:`restart`.
    extra_conf : str
        More configuration lines.
    binary : str, optional
        The ``mosquitto`` executable (default: :func:`find_mosquitto`).
    deploy_conf : bool or path
        Start from the shipped production configuration (True:
        :data:`DEPLOY_CONF`, or the file given), adapted by
        :func:`adapt_deploy_conf`: its limits as shipped, one plain listener,
        this broker's passwords and ACL. ``persistence`` is then the file's;
        ``message_size_limit``, ``max_packet_size`` and ``extra_conf``, when
        given, are written after it.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        acl: str | None = None,
        passwords: Mapping[str, str] | None = None,
        allow_anonymous: bool | None = None,
        message_size_limit: int | None = None,
        max_packet_size: int | None = None,
        persistence: bool = True,
        extra_conf: str = "",
        binary: str | None = None,
        deploy_conf: bool | str | os.PathLike[str] = False,
    ) -> None:
        self.binary = binary or find_mosquitto()
        if self.binary is None:
            raise FileNotFoundError("mosquitto is not installed (not on PATH nor at /usr/sbin/mosquitto)")
        for name, value in (("message_size_limit", message_size_limit), ("max_packet_size", max_packet_size)):
            if value is not None and int(value) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for user in passwords or {}:
            if not user or ":" in user or any(c.isspace() for c in user):
                raise ValueError(f"user name {user!r} must be non-empty, without ':' or whitespace")
        self.host = host
        self.port = port
        self.acl = acl
        self.passwords = dict(passwords) if passwords else None
        self.allow_anonymous = (self.passwords is None) if allow_anonymous is None else bool(allow_anonymous)
        self.message_size_limit = message_size_limit
        self.max_packet_size = max_packet_size
        self.persistence = persistence
        self.extra_conf = extra_conf
        self.deploy_conf: Path | None = (DEPLOY_CONF if deploy_conf is True else
                                         Path(deploy_conf) if deploy_conf else None)
        if self.deploy_conf is not None and not self.deploy_conf.is_file():
            raise FileNotFoundError(f"no broker configuration at {self.deploy_conf} (deploy/ is in the checkout, "
                                    "not in the installed package)")
        self._dir: Path | None = None
        self._process = BrokerProcess("mosquitto")

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"MosquittoBroker(url={self.url!r}, {state})"

    @property
    def url(self) -> str:
        """``mqtt://host:port`` (port None before the first start)."""
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the subprocess is alive."""
        return self._process.running

    @property
    def pid(self) -> int | None:
        """Process id of the running mosquitto (None when stopped)."""
        return self._process.pid

    @property
    def directory(self) -> Path | None:
        """The temporary folder with the configuration, password file, ACL, database and log."""
        return self._dir

    def log_text(self) -> str:
        """Mosquitto's log so far (for debugging failed tests)."""
        if self._dir is None or not (self._dir / "mosquitto.log").exists():
            return ""
        return (self._dir / "mosquitto.log").read_text(errors="replace")

    def _write_files(self) -> Path:
        assert self._dir is not None
        if self.deploy_conf is not None:
            return self._write_deploy_files()
        d = self._dir
        lines = [
            "# written by server_kit.broker.MosquittoBroker",
            f"listener {self.port} {self.host}",
            f"allow_anonymous {'true' if self.allow_anonymous else 'false'}",
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {d}/",
            f"log_dest file {d / 'mosquitto.log'}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            lines.append("user root")  # otherwise mosquitto drops to 'mosquitto' and cannot read our files
        if self.message_size_limit is not None:
            lines.append(f"message_size_limit {int(self.message_size_limit)}")
        if self.max_packet_size is not None:
            lines.append(f"max_packet_size {int(self.max_packet_size)}")
        if self.passwords is not None:
            pw = d / "passwd"
            self._write_passwords(pw)
            lines.append(f"password_file {pw}")
        if self.acl is not None:
            acl = d / "acl"
            acl.write_text(self.acl if self.acl.endswith("\n") else self.acl + "\n")
            acl.chmod(0o600)
            lines.append(f"acl_file {acl}")
        if self.extra_conf:
            lines.append(self.extra_conf)
        conf = d / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _write_deploy_files(self) -> Path:
        assert self._dir is not None and self.deploy_conf is not None and self.port is not None
        d = self._dir
        pw = acl = None
        if self.passwords is not None:
            pw = d / "passwd"
            self._write_passwords(pw)
        if self.acl is not None:
            acl = d / "acl"
            acl.write_text(self.acl if self.acl.endswith("\n") else self.acl + "\n")
            acl.chmod(0o600)
        text = adapt_deploy_conf(self.deploy_conf.read_text(), port=self.port, host=self.host, directory=d,
                                 password_file=str(pw) if pw else None, acl_file=str(acl) if acl else None)
        extra = [f"message_size_limit {int(self.message_size_limit)}"] if self.message_size_limit is not None else []
        if self.max_packet_size is not None:
            extra.append(f"max_packet_size {int(self.max_packet_size)}")
        if self.extra_conf:
            extra.append(self.extra_conf)
        conf = d / "mosquitto.conf"
        conf.write_text(text + "".join(line + "\n" for line in extra))
        return conf

    def _write_passwords(self, path: Path) -> None:
        assert self.passwords is not None
        tool = _find_passwd_tool(self.binary or "mosquitto")
        if tool is None:
            raise FileNotFoundError("mosquitto_passwd is needed to write a password file and is not installed")
        if any("\n" in pw or "\r" in pw for pw in self.passwords.values()):
            raise ValueError("passwords must not contain line breaks")
        path.write_text("")
        path.chmod(0o600)
        # one "user:password" line each, hashed in place by one run of mosquitto_passwd -U (thousands of users
        # take a second, where one run per user took minutes)
        path.write_text("".join(f"{user}:{pw}\n" for user, pw in self.passwords.items()))
        subprocess.run([tool, "-U", str(path)], check=True, capture_output=True, timeout=300)

    def start(self, timeout: float = 10.0) -> str:
        """Write the configuration, start mosquitto, wait for its port; returns the URL."""
        if self.running:
            return self.url
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="fedsketch-mosquitto-"))
        if self.port is None:
            self.port = free_port(self.host)
        conf = self._write_files()
        self._process.spawn([self.binary, "-c", str(conf)], self)
        try:
            wait_port(self.host, self.port, timeout, alive=lambda: self._process.running)
        except (RuntimeError, TimeoutError) as e:
            err = self._process.stderr_text()
            self.stop()
            raise RuntimeError(f"mosquitto did not start on port {self.port}: {e}\n{err}{self.log_text()}") from None
        log.info("mosquitto %s listening on %s (dir %s)", self.binary, self.url, self._dir)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop mosquitto (SIGTERM: it saves its database first); keeps the folder for :meth:`restart`."""
        self._process.stop(timeout)

    def restart(self, timeout: float = 10.0) -> str:
        """Stop and start again on the same port with the same database."""
        self.stop(timeout)
        return self.start(timeout)

    def cleanup(self) -> None:
        """Stop and delete the temporary folder."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

