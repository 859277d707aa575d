#!/bin/bash
# Portable initial weights on the arm64 install (no torch there): edge_sdk.models.portable_init.initial_tensors of LeNet-5
# (seed 0) and DigitsCNN (seed 3), built from the specs written literally in tests/pi/portable_init.json, hash to the
# x86 values pinned there (and in tests/edge_sdk/test_portable_init.py); the first draws also match a pure-Python
# SplitMix64 and 4 pinned bit patterns. The same check runs on the host first. Exit non-zero on any difference.
source "$(dirname "$0")/lib.sh"
W=$R/root/work
[ -d "$W" ] || { log "no $W: run pi_check.sh first"; exit 1; }
cp "$SRC/tests/pi/portable_init.json" "$W/portable_init.json" || exit 1
cat > "$W/portable_init_check.py" <<'PY'
import json
import sys

import numpy as np

from edge_sdk.models.portable_init import initial_tensors, portable_uniform, tensors_sha256

M = (1 << 64) - 1


def splitmix64(state, n):
    """The reference: n outputs of SplitMix64 from a state, in Python integers."""
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & M
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        out.append(z ^ (z >> 31))
    return out


fixture = json.load(open(sys.argv[1]))
bad = []
for seed, stream in ((0, 0), (3, 7), (2**64 - 1, 2**32 - 1)):
    seed_mix = splitmix64((seed * 0x9E3779B97F4A7C15 - 0x9E3779B97F4A7C15) & M, 1)[0]
    ref = [(z >> 40) * 2.0**-24 for z in splitmix64(((seed_mix + (stream << 32)) * 0x9E3779B97F4A7C15) & M, 5)]
    got = portable_uniform(seed, stream, 5).tolist()
    if got != ref:
        bad.append(f"portable_uniform({seed}, {stream}, 5) = {got}, SplitMix64 gives {ref}")
built = []
for case in fixture["cases"]:
    spec = {name: (tuple(shape), dtype) for name, shape, dtype in case["spec"]}
    weights = initial_tensors(spec, case["seed"])
    built.append(weights)
    digest = tensors_sha256(weights)
    ok = digest == case["sha256"]
    print(f"{case['architecture']} seed {case['seed']}: sha256 {digest} {'ok' if ok else 'DIFFERS from ' + case['sha256']}")
    if not ok:
        bad.append(f"{case['architecture']} seed {case['seed']}")
first = fixture["first_bits"]
bits = [hex(b) for b in built[first["case"]][first["tensor"]].reshape(-1)[:4].view(np.uint32).tolist()]
if bits != first["uint32"]:
    bad.append(f"first bits of {first['tensor']}: {bits}, pinned {first['uint32']}")
print("portable initial weights: " + ("identical to the pinned x86 values" if not bad else "MISMATCH: " + "; ".join(bad)))
sys.exit(1 if bad else 0)
PY
"$HOSTVENV/bin/python" "$W/portable_init_check.py" "$W/portable_init.json" > "$PI/portable_init_host.txt" 2>&1 \
  || { log "portable initial weights on the x86 host FAILED"; cat "$PI/portable_init_host.txt"; exit 1; }
t0=$(date +%s)
"$INCHROOT" 'python portable_init_check.py portable_init.json' > "$PI/portable_init_arm.txt" 2>&1; rc=$?
log "arm64 portable_init_check.py: rc=$rc in $(( $(date +%s) - t0 )) s"
grep -v MIDR_EL1 "$PI/portable_init_arm.txt"
[ $rc = 0 ] || { log "portable initial weights on arm64 DIFFER from the pinned x86 values (or an error)"; exit 1; }
log "portable initial weights: arm64 == x86 host == pinned (LeNet-5 seed 0, DigitsCNN seed 3)"
