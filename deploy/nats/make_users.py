#!/usr/bin/env python3
"""Write the NATS users of a FedSketch federation: the server and one user per device, with deploy/acl's rights.

    usage: deploy/nats/make_users.py N [--out FILE] [--prefix c] [--federation NAME ...] [--root fedsketch]
           deploy/nats/make_users.py --ids c01,gw-7,... [--out FILE] ...
    e.g.:  sudo deploy/nats/make_users.py 20 --federation demo --out /etc/nats/fedsketch-users.conf > passwords.txt

NATS permissions are NATS subjects (an MQTT topic's "/" is a ".", "+" is
"*", "#" is ">") and NATS 2.9 has nothing like Mosquitto's %u (the user's
own name in a pattern), so each device gets a user block of its own naming
its own topics. Per federation, a device may:

  - publish only the five leaves it speaks under its own clients/<id>/
    (hello, sketch, update, status and its last will, metrics): not its own
    cmd topic, nothing deeper;
  - subscribe only to its own cmd, the cluster models (clusters/*/model),
    the broadcast commands and the server's status;
  - subscribe to $MQTT.sub.>, where NATS delivers an MQTT client's QoS 1
    subscriptions (NATS 2.9 checks it; from 2.14 it is implicit);
  - connect over MQTT only (allowed_connection_types): as a plain NATS
    client it could subscribe to $MQTT.sub.>, every MQTT client's QoS 1
    deliveries.

The user "server" publishes and subscribes to the federation's whole tree.

Each user gets a random password, printed ONCE on standard output as "user
password" lines (as deploy/make_passwords.sh does): hand each to its device
(--password-file) and keep the list safe. The file holds bcrypt hashes when
this Python can make them (its crypt module, up to Python 3.12, or the
bcrypt package), else the passwords themselves (say --plain to accept that;
keep the file mode 600). Running it again replaces the file and every
password. Reload every node after copying it: `nats-server --signal reload`.

Ids: NATS 2.9 refuses MQTT topics with "." (from 2.10 it maps "." to "//"),
and "*" and ">" inside a topic are NATS wildcards, so device ids with ".",
"*", ">", whitespace, "/", "+", "#", quotes or a leading "$" are refused here.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import string
import sys
import warnings

#: The leaves a device publishes under its own clients/<id>/ (deploy/acl's five).
DEVICE_LEAVES = ("hello", "sketch", "update", "status", "metrics")
_FORBIDDEN = set(" \t\r\n/+#.*>\"'\\")


def check_id(value: str, what: str = "id") -> str:
    """``value`` if it can be a NATS subject token and an MQTT topic level on NATS 2.9; else SystemExit."""
    bad = sorted({c for c in value if c in _FORBIDDEN or not c.isprintable() or c.isspace()})
    if not value or bad or value.startswith("$"):
        why = "is empty" if not value else ("starts with '$'" if not bad else f"holds {''.join(bad)!r}")
        raise SystemExit(f"{what} {value!r} {why}: NATS cannot carry it in an MQTT topic or a permission "
                         "(use letters, digits, '-' and '_')")
    return value


def device_permissions(cid: str, federations: list[str], root: str) -> dict[str, list[str]]:
    """The NATS permissions of device ``cid``: deploy/acl's rights, in NATS subjects."""
    pub, sub = [], []
    for fed in federations:
        base = f"{root.replace('/', '.')}.{fed}"
        pub += [f"{base}.clients.{cid}.{leaf}" for leaf in DEVICE_LEAVES]
        pub.append(f"{base}.clients.{cid}.update.*")  # an update on the partition its train command names
        sub += [f"{base}.clients.{cid}.cmd", f"{base}.clusters.*.model", f"{base}.broadcast.cmd",
                f"{base}.server.status"]
    return {"publish": pub, "subscribe": sub + ["$MQTT.sub.>"]}


def server_permissions(federations: list[str], root: str) -> dict[str, list[str]]:
    """The server's NATS permissions: each federation's whole tree."""
    trees = [f"{root.replace('/', '.')}.{fed}.>" for fed in federations]
    return {"publish": trees, "subscribe": trees + ["$MQTT.sub.>"]}


def ingest_permissions(index: int, federations: list[str], root: str) -> dict[str, list[str]]:
    """Ingest worker ``index``'s NATS permissions: its partition of the updates, the server's aggregation
    messages; it writes under its own ``aggregators/ingest-<index>/``."""
    pub, sub = [], []
    for fed in federations:
        base = f"{root.replace('/', '.')}.{fed}"
        pub.append(f"{base}.aggregators.ingest-{index}.>")
        sub += [f"{base}.clients.*.update.{index}", f"{base}.aggregation.cmd"]
    return {"publish": pub, "subscribe": sub + ["$MQTT.sub.>"]}


def _hasher(cost: int) -> object | None:
    """A function password -> bcrypt hash of ``2**cost`` rounds, or None when this Python has none."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # Python <= 3.12, glibc's libxcrypt
        if crypt.METHOD_BLOWFISH in crypt.methods:
            return lambda pw: crypt.crypt(pw, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=2 ** cost))
    except ImportError:
        pass
    try:
        import bcrypt  # type: ignore[import-not-found]

        return lambda pw: bcrypt.hashpw(pw.encode(), bcrypt.gensalt(cost)).decode()
    except ImportError:
        return None


def render(users: list[tuple[str, str, dict[str, list[str]]]]) -> str:
    """The ``authorization`` block: one ``{user, password, permissions, allowed_connection_types}`` per user."""
    q = json.dumps  # a double-quoted NATS string: a bare "$2b$..." would read as a variable
    lines = ["# written by deploy/nats/make_users.py: the server and one user per device (see its docstring)",
             "authorization {", "  users = ["]
    for user, password, perms in users:
        lines.append(f"    {{user: {q(user)}, password: {q(password)}, allowed_connection_types: [\"MQTT\"],")
        lines.append(f"     permissions: {{publish: {q(perms['publish'])},")
        lines.append(f"                   subscribe: {q(perms['subscribe'])}}}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, help="number of devices, named PREFIX01..PREFIXN")
    ap.add_argument("--ids", help="comma-separated device ids instead of N")
    ap.add_argument("--prefix", default="c", help="device id prefix with N (default: c)")
    ap.add_argument("--federation", action="append", help="federation (repeat for several; default: default)")
    ap.add_argument("--root", default="fedsketch", help="topic root (default: fedsketch)")
    ap.add_argument("--server-user", default="server", help="the server's user name (default: server)")
    ap.add_argument("--ingest-workers", type=int, default=0, metavar="W",
                    help="also the users of the server's W ingest workers (<server-user>-ingest-<i>, the server's "
                         "password; fedsketch-server --ingest-workers W)")
    ap.add_argument("--out", default="fedsketch-users.conf", help="file to write (default: fedsketch-users.conf)")
    ap.add_argument("--plain", action="store_true", help="write the passwords themselves if no bcrypt is at hand")
    ap.add_argument("--cost", type=int, default=11,
                    help="bcrypt cost (2**COST rounds; default 11, as `nats server passwd`): NATS checks the hash "
                         "at every connection, so a fleet reconnecting at once pays it per device")
    args = ap.parse_args(argv)
    if (args.n is None) == (args.ids is None):
        ap.error("give N or --ids, not both")
    if args.n is not None:
        if args.n < 1:
            ap.error(f"N must be at least 1, got {args.n}")
        width = max(2, len(str(args.n)))
        ids = [f"{args.prefix}{i:0{width}d}" for i in range(1, args.n + 1)]
    else:
        ids = [s.strip() for s in args.ids.split(",") if s.strip()]
    federations = args.federation or ["default"]
    for fed in federations:
        check_id(fed, "federation")
    for level in args.root.split("/"):
        check_id(level, "topic root level")
    for cid in ids:
        check_id(cid, "device id")
    check_id(args.server_user, "server user")
    if len(set(ids + [args.server_user])) != len(ids) + 1:
        raise SystemExit("device ids must be distinct and differ from the server's user name")
    if not 0 <= args.ingest_workers <= 256:
        ap.error(f"--ingest-workers must be in [0, 256], got {args.ingest_workers}")
    if not 4 <= args.cost <= 31:
        ap.error(f"--cost must be in [4, 31], got {args.cost}")
    hasher = _hasher(args.cost)
    if hasher is None and not args.plain:
        raise SystemExit("no bcrypt here (Python >= 3.13 without the bcrypt package): pip install bcrypt, or "
                         "--plain to store the passwords themselves (nats-server then warns 'Plaintext passwords')")
    alphabet = string.ascii_letters + string.digits
    plain = [(user, "".join(secrets.choice(alphabet) for _ in range(24)))
             for user in [args.server_user, *ids]]
    users = [(args.server_user, plain[0][1], server_permissions(federations, args.root))]
    users += [(f"{args.server_user}-ingest-{i}", plain[0][1], ingest_permissions(i, federations, args.root))
              for i in range(args.ingest_workers)]
    users += [(cid, pw, device_permissions(cid, federations, args.root)) for cid, pw in plain[1:]]
    text = render([(u, hasher(pw) if hasher else pw, p) for u, pw, p in users])  # type: ignore[operator]
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(args.out, 0o600)
    for user, pw in plain:
        print(user, pw)
    print(f"wrote {len(users)} users to {args.out} ({'bcrypt' if hasher else 'PLAIN'} passwords); the passwords "
          "above are not stored anywhere else", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
