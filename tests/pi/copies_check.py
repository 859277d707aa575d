"""The server's copies of a model and its devices' under every codec, on this machine: one line per codec.

Run on the x86 host and on the emulated Pi (tests/pi/copies.sh diffs the two outputs): numpy only (no
torch), the server's :class:`server_kit.downstream.ModelVersions` and the devices'
:class:`edge_sdk.models.held_models.ModelStore`, 6 rounds of exact float32 changes drawn with the portable
generator (and 12 more batches a round on a BatchNorm counter, an integer tensor). Device "a" gets every round, "b" every third (chains and merged catch-ups), "c" only the
last (its first model free, then current). Exits 1 when a device's copy differs from the server's.
"""

from __future__ import annotations

import sys

import numpy as np

from edge_sdk.compress import Compression
from edge_sdk.models.held_models import ModelStore
from edge_sdk.models.portable_init import initial_tensors, portable_uniform, tensors_sha256
from edge_sdk.protocol import SERVER_ID, Kind, Message
from server_kit.downstream import ModelVersions

SPEC = {"conv.weight": ((6, 1, 5, 5), "float32"), "conv.bias": ((6,), "float32"),
        "bn.running_mean": ((6,), "float32"), "bn.running_var": ((6,), "float32"),
        "bn.num_batches_tracked": ((), "int64"),  # an integer counter: its change rounded, kept integer
        "fc.weight": ((10, 600), "float32"), "fc.bias": ((10,), "float32")}
CODECS = ("int8", "int4", "sign", "rsign", "rtern", "rint2", "topk:0.05", "stc:0.05")
ROUNDS = 6


def trained(weights: dict[str, np.ndarray], rnd: int) -> dict[str, np.ndarray]:
    """A round's aggregate: each entry moved by up to 0.01, drawn portably (exact float32 steps)."""
    out = {}
    for i, (name, w) in enumerate(sorted(weights.items())):
        if w.dtype.kind == "i":  # a counter: 12 batches a round
            out[name] = w + np.int64(12)
            continue
        u = portable_uniform(1000 + rnd, i, w.size).reshape(w.shape)
        out[name] = w + (u * np.float32(0.02) - np.float32(0.01))
    return out


def run(codec: str) -> tuple[str, bool, int]:
    versions = ModelVersions(Compression.parse(codec))
    w0 = initial_tensors(SPEC, 0)
    versions.note_initial("pi-spec", 0, w0)
    models = {"c0": w0}
    versions.sync(models)
    stores = {d: ModelStore(build_initial=lambda arch, seed: initial_tensors(SPEC, seed)) for d in "abc"}
    held: dict[str, int | None] = dict.fromkeys(stores)
    sent = 0

    def send(device: str, rnd: int) -> None:
        nonlocal sent
        meta, body = versions.payload("c0", held[device], models["c0"])
        stores[device].receive("c0", Message(Kind.MODEL, "pi", SERVER_ID, rnd, meta, body), meta)
        held[device] = versions.version["c0"]
        sent += len(body)

    for rnd in range(1, ROUNDS + 1):
        for device in ("a", "b") if rnd % 3 == 1 else ("a",):
            send(device, rnd)
        models["c0"] = trained(models["c0"], rnd)
        versions.commit(models)
    for device in "abc":
        send(device, ROUNDS + 1)
    send("c", ROUNDS + 2)  # current: nothing
    want = tensors_sha256(models["c0"])
    same = all(tensors_sha256(s.get("c0").weights) == want for s in stores.values())
    return want, same, sent


def main() -> int:
    ok = True
    print(f"initial {tensors_sha256(initial_tensors(SPEC, 0))}")
    for codec in CODECS:
        sha, same, sent = run(codec)
        ok &= same
        print(f"{codec:10s} {sha} devices {'equal' if same else 'DIFFER'} bytes {sent}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
