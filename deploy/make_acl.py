#!/usr/bin/env python3
"""Write FedSketch's Mosquitto ACL (deploy/acl) for the federations, topic root and ingest workers given.

    usage: deploy/make_acl.py [--federation NAME ...] [--root fedsketch] [--server-user server]
                              [--ingest-workers W] > /etc/mosquitto/fedsketch.acl
    e.g.:  deploy/make_acl.py --federation lab --ingest-workers 16 > fedsketch.acl

The shipped deploy/acl is this script's output with its defaults (the
federation "default", 8 ingest workers). Mosquitto 2.0 has no rule that
names a partition by a number inside a user name, so worker i (user
<server-user>-ingest-<i>) gets a section of its own: it reads only its
partition of the update topics (clients/+/update/<i>) and the server's
aggregation commands, and writes only under aggregators/ingest-<i>/.
Sections for workers that do not run are harmless: a user not in the
password file cannot log in (deploy/make_passwords.sh N FILE PREFIX W adds
the W workers' users). A server started with more workers than the ACL
names stops at start: its probe of the missing worker's partition gets no
answer, and it says which user and topic.
"""

from __future__ import annotations

import argparse
import sys

#: The workers the shipped deploy/acl names (fedsketch-server --ingest-workers up to this many).
SHIPPED_WORKERS = 8

HEADER = '# FedSketch ACL for Mosquitto 2.x (acl_file), for ONE federation: "default", and a server with up to\n# 8 ingest workers. Written by deploy/make_acl.py; for another federation, several, another --root or\n# more ingest workers, write your own with it:\n#     deploy/make_acl.py --federation lab --ingest-workers 16 > /etc/mosquitto/fedsketch.acl\n# (or rewrite the prefix: sed \'s#fedsketch/default/#fedsketch/lab/#\' deploy/acl). With several\n# federations a device may write only in the federations listed.\n#\n# Each Raspberry Pi logs in with its client id as user name (%u below), so it may:\n#   - write only the five leaves it speaks under its own\n#     fedsketch/default/clients/<id>/  (hello, sketch, update, status and its\n#     last will, metrics), and its update on a partition (update/<p>, when the\n#     server has ingest workers): not its own cmd topic, nothing else deeper;\n#   - read only its own commands, the cluster models, the broadcast commands and the\n#     server\'s status (its run announcements, for service mode).\n# It cannot read another client\'s topics, publish as another client, nor\n# read everything with a wildcard.\n#\n# How Mosquitto 2.0 enforces this: a denied PUBLISH is dropped silently (MQTT\n# 3.1.1 has no way to say no; MQTT 5 gets a "not authorized" PUBACK). A\n# SUBSCRIBE to a topic the client may not read is GRANTED, not refused; the\n# broker then checks every message against the ACL at delivery and drops what\n# the client may not read. So a snooping subscription "succeeds" and receives\n# nothing: do not take a granted subscription as proof of access.\n#\n# Retained messages: deploy/mosquitto.conf sets retain_available false, so a\n# client that publishes with the retain flag is disconnected. FedSketch\n# retains nothing, and its programs ignore retained messages on device topics.\n#\n# `pattern` lines apply to every authenticated user; `user` sections add rights.\n\n'


def render(federations: list[str], root: str = "fedsketch", server_user: str = "server",
           workers: int = SHIPPED_WORKERS) -> str:
    """The ACL text: the devices' patterns, the server's tree, then one section per ingest worker."""
    bases = [f"{root}/{fed}" for fed in federations]
    out = [HEADER.replace("fedsketch/default/", f"{bases[0]}/").rstrip("\n") + "\n"]
    for base in bases:
        out += [f"pattern write {base}/clients/%u/{leaf}" for leaf in ("hello", "sketch", "update")]
        out.append(f"pattern write {base}/clients/%u/update/+")
        out += [f"pattern write {base}/clients/%u/{leaf}" for leaf in ("status", "metrics")]
        out += [f"pattern read {base}/clients/%u/cmd", f"pattern read {base}/clusters/+/model",
                f"pattern read {base}/broadcast/cmd", f"pattern read {base}/server/status"]
    out += ["", f"# The server (user \"{server_user}\") reads and writes the federation's whole tree.",
            f"user {server_user}"]
    out += [f"topic readwrite {base}/#" for base in bases]
    out += ["", f"# The server's ingest workers (fedsketch-server --ingest-workers W, W <= {workers} here): worker i "
            f"logs in as \"{server_user}-ingest-<i>\"",
            "# with the server's password (deploy/make_passwords.sh N FILE PREFIX W adds those users). Worker i "
            "reads the devices'",
            "# updates on its partition i of the update topics and the server's aggregation messages, and writes "
            "its receipts and",
            "# partial sums."]
    for i in range(workers):
        out.append(f"user {server_user}-ingest-{i}")
        for base in bases:
            out += [f"topic read {base}/clients/+/update/{i}", f"topic read {base}/aggregation/cmd",
                    f"topic write {base}/aggregators/ingest-{i}/#"]
    return "\n".join(out) + "\n"


def _level(value: str, what: str) -> str:
    if not value or any(c in value for c in "/+#\0 \t\r\n") or value.startswith("$"):
        raise SystemExit(f"make_acl.py: {what} {value!r} cannot be an MQTT topic level")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--federation", action="append", help="federation (repeat for several; default: default)")
    ap.add_argument("--root", default="fedsketch", help="topic root (default: fedsketch)")
    ap.add_argument("--server-user", default="server", help="the server's user name (default: server)")
    ap.add_argument("--ingest-workers", type=int, default=SHIPPED_WORKERS, metavar="W",
                    help=f"sections for W ingest workers (default: {SHIPPED_WORKERS})")
    args = ap.parse_args(argv)
    if not 0 <= args.ingest_workers <= 256:
        ap.error(f"--ingest-workers must be in [0, 256], got {args.ingest_workers}")
    federations = [_level(f, "federation") for f in (args.federation or ["default"])]
    for level in args.root.split("/"):
        _level(level, "topic root level")
    _level(args.server_user, "server user")
    sys.stdout.write(render(federations, args.root, args.server_user, args.ingest_workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
