#!/bin/bash
# Device health on the arm64 install (no torch there): read_health reads a Raspberry Pi's board files (a fake
# /sys/class/thermal with a cpu-thermal zone at 61.234 C and the firmware's get_throttled at 0x50005, written under
# a temp folder) as on x86, the emulated board's own readings pass the schema of a hello and a status, and a health
# out of range is refused with the same words as on x86. Exit non-zero on any difference.
source "$(dirname "$0")/lib.sh"
W=$R/root/work
[ -d "$W" ] || { log "no $W: run pi_check.sh first"; exit 1; }
cat > "$W/health_check.py" <<'PY'
import json
import sys
import tempfile
from pathlib import Path

from edge_sdk.health import BoardFiles, read_health
from edge_sdk.protocol import Kind, ProtocolError
from edge_sdk.schema import check_fields

root = Path(tempfile.mkdtemp())
(root / "thermal" / "thermal_zone0").mkdir(parents=True)
(root / "thermal" / "thermal_zone0" / "type").write_text("gpu-thermal\n")
(root / "thermal" / "thermal_zone0" / "temp").write_text("45000\n")
(root / "thermal" / "thermal_zone1").mkdir()
(root / "thermal" / "thermal_zone1" / "type").write_text("cpu-thermal\n")
(root / "thermal" / "thermal_zone1" / "temp").write_text("61234\n")
(root / "get_throttled").write_text("50005\n")
(root / "meminfo").write_text("MemTotal:        3884096 kB\nMemFree:  100 kB\nMemAvailable:    2097152 kB\n")
pi = read_health(BoardFiles(str(root / "thermal"), str(root / "get_throttled"), "no-vcgencmd",
                            str(root / "meminfo")), round_s=12.5, model_version=3, kept="c0@1a2b3c4d5e6f")
fake = {k: v for k, v in pi.to_meta().items() if k != "load1"}
own = read_health().to_meta()
hello = {"n_samples": 10, "health": own}
accepted = [check_fields(kind, meta)["health"] == own for kind, meta in ((Kind.HELLO, hello),
                                                                          (Kind.STATUS, {"health": own}))]
try:
    check_fields(Kind.STATUS, {"health": {"cpu_temp_c": 999.0}})
    refused = "accepted"
except ProtocolError as e:
    refused = str(e)
print(json.dumps({"fake_pi": fake, "throttling_now": pi.throttling_now, "flags": list(pi.throttle_flags),
                  "own_fields": sorted(own), "accepted": accepted, "refused": refused}, sort_keys=True))
PY
"$HOSTVENV/bin/python" "$W/health_check.py" > "$PI/health_host.txt" 2>&1 \
  || { log "device health on the x86 host FAILED"; cat "$PI/health_host.txt"; exit 1; }
t0=$(date +%s)
"$INCHROOT" 'python health_check.py' > "$PI/health_arm.txt" 2>&1; rc=$?
log "arm64 health_check.py: rc=$rc in $(( $(date +%s) - t0 )) s"
grep -v MIDR_EL1 "$PI/health_arm.txt"
[ $rc = 0 ] || { log "device health on arm64 FAILED"; exit 1; }
python3 - "$PI/health_host.txt" "$PI/health_arm.txt" <<'PY' || exit 1
import json
import sys

host, arm = (json.loads([l for l in open(p) if l.startswith("{")][-1]) for p in sys.argv[1:3])
want = {"cpu_temp_c": 61.2, "throttled": 0x50005, "mem_total_mb": 3793.1, "mem_available_mb": 2048.0,
        "round_s": 12.5, "model_version": 3, "kept": "c0@1a2b3c4d5e6f"}
bad = [f"{side}: {k}" for side, r in (("x86", host), ("arm64", arm)) for k in ("fake_pi", "throttling_now", "flags",
                                                                               "accepted", "refused")
       if r[k] != host[k] or (k == "fake_pi" and r[k] != want) or (k == "accepted" and r[k] != [True, True])
       or (k == "throttling_now" and r[k] is not True)]
if "mem_total_mb" not in arm["own_fields"]:
    bad.append("arm64: the emulated board's own memory was not read")
print("device health: " + ("arm64 == x86 host (board files, schema, refusal)" if not bad else "DIFFER: " + ", ".join(bad)))
sys.exit(1 if bad else 0)
PY
log "device health: arm64 == x86 host"
