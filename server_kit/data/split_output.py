"""What ``fedsketch-data split`` leaves: one ``.npz`` per client, ``truth.json``, a summary, the next commands."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from server_kit.data.clients import ClientData, save_client
from server_kit.data.sources import PROG, Source
from server_kit.data.split_partition import class_count

__all__ = ["split_summary", "write_clients"]

#: The command's logger: its lines keep the name ``fedsketch-data`` has always printed.
logger = logging.getLogger("server_kit.data.split")


def write_clients(clients: Sequence[ClientData], out: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``OUT/<cid>.npz`` per client and ``OUT/truth.json`` (``{cid: group}``); returns the truth path.

    An ``out`` that already holds ``.npz`` files or a ``truth.json`` is refused
    unless ``overwrite``; then the client files of the old ``truth.json`` that
    the new split does not have are removed, so no stale client is left.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    truth_path = out / "truth.json"
    if out.is_dir():
        old = sorted(p.name for p in out.glob("*.npz")) + (["truth.json"] if truth_path.exists() else [])
        if old and not overwrite:
            shown = ", ".join(old[:3]) + (", ..." if len(old) > 3 else "")
            raise ValueError(f"--out {out} already holds {shown}; pass --overwrite or another --out")
        if old and truth_path.exists():
            try:
                stale = set(json.loads(truth_path.read_text())) - {c.cid for c in clients}
            except (OSError, ValueError, TypeError):
                stale = set()
            for cid in sorted(stale):
                f = out / f"{cid}.npz"
                if f.is_file():
                    f.unlink()
                    logger.info("removed stale %s", f)
    out.mkdir(parents=True, exist_ok=True)
    for c in clients:
        save_client(out / f"{c.cid}.npz", c)
    truth = {c.cid: int(c.group) for c in clients}
    truth_path.write_text(json.dumps(truth, indent=1) + "\n")
    return truth_path


def _span(values: Sequence[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _group_note(p: str, g: int, members: Sequence[ClientData], num_classes: int) -> str:
    if p in ("rotation", "uneven"):
        return f"rotated {90 * g} degrees"
    if p == "label-flip":
        return "labels unchanged" if g == 0 else f"labels y -> (y - {g}) mod {num_classes}"
    if p == "dirichlet":
        return "label skew only"
    classes = sorted({int(v) for c in members for a in (c.y_train, c.y_test) for v in np.unique(a)})
    return f"classes {classes}"


def split_summary(source: Source, clients: Sequence[ClientData], args: argparse.Namespace, truth: Path) -> str:
    """The lines printed after a split: the clients per group, the files written, the commands to run next."""
    out = Path(args.out)
    n_train = [len(c.y_train) for c in clients]
    n_test = [len(c.y_test) for c in clients]
    n_total = [a + b for a, b in zip(n_train, n_test)]
    shape = source.x.shape[1:]
    shape_text = "x".join(str(d) for d in shape)
    by_group: dict[int, list[ClientData]] = {}
    for c in clients:
        by_group.setdefault(int(c.group), []).append(c)
    num_classes = class_count(source, args, at_least=2 if args.partition == "label-flip" else 1)
    lines = [
        f"{PROG}: {len(clients)} clients in {len(by_group)} groups (--partition {args.partition}) from "
        f"{source.name}: {len(source.y)} samples ({args.split}), {shape_text} images, {num_classes} classes",
        f"  samples per client: {_span(n_total)} (train {_span(n_train)}, test {_span(n_test)})",
    ]
    for g, members in sorted(by_group.items()):
        ids = " ".join(c.cid for c in members)
        lines.append(f"  group {g} ({_group_note(args.partition, g, members, num_classes)}): "
                     f"{len(members)} clients: {ids}")
    lines.append(f"  wrote {out / clients[0].cid}.npz .. {clients[-1].cid}.npz and {truth}")
    lines.append("")
    lines.extend(_next_commands(len(clients), shape, num_classes, out))
    return "\n".join(lines)


def _next_commands(n_clients: int, shape: tuple[int, ...], num_classes: int, out: Path) -> list[str]:
    from edge_sdk.models.artifacts import models_for_shape

    broker = "mqtt://127.0.0.1:1883"
    encoder, architecture = models_for_shape(tuple(shape))
    server = ["fedsketch-server", "--broker", broker, "--federation", "lab", "--strategy", "fedsketch",
              "--min-clients", str(n_clients), "--num-classes", str(num_classes),
              "--truth", str(out / "truth.json")]
    note = []
    if encoder is None or architecture is None:
        note = [f"(no shipped encoder or classifier takes {'x'.join(map(str, shape))} inputs: give the server "
                "--encoder and --architecture, for models of your own)"]
    else:
        note = [f"(the server picks {encoder} and {architecture} for these {'x'.join(map(str, shape))} samples "
                "and tells the devices)"]
    client = ["fedsketch-client", "--broker", broker, "--federation", "lab",
              "--client-id", '"$(basename "$f" .npz)"', "--data", '"$f"']
    glob = shlex.quote(str(out)) + "/*.npz"
    return [
        "next: with an MQTT broker on 127.0.0.1:1883 (e.g. `mosquitto -p 1883 &`), run the server, "
        "then one client per file:",
        "  " + " ".join(shlex.quote(a) for a in server) + " --report-dir reports/lab &",
        f"  for f in {glob}; do {' '.join(client)} & done; wait",
        *note,
    ]
