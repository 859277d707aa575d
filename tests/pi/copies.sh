#!/bin/bash
# The server's and the devices' copies of a model stay bit-identical under every codec (int8, int4, sign, rsign, rtern, rint2,
# top-k, STC; chains, merged catch-ups, the free first model, "current"), and the arm64 install computes the
# same hashes as the x86 host: tests/pi/copies_check.py on both, its outputs diffed.
source "$(dirname "$0")/lib.sh"
W=$R/root/work
[ -d "$W" ] || { log "no $W: run pi_check.sh first"; exit 1; }
cp "$SRC/tests/pi/copies_check.py" "$W/copies_check.py"
"$HOSTVENV/bin/python" "$SRC/tests/pi/copies_check.py" > "$PI/copies_host.txt" 2>&1 \
  || { log "copies on the x86 host FAILED"; cat "$PI/copies_host.txt"; exit 1; }
t0=$(date +%s)
"$INCHROOT" 'python copies_check.py' > "$PI/copies_arm.txt" 2>&1; rc=$?
log "arm64 copies_check.py: rc=$rc in $(( $(date +%s) - t0 )) s"
cat "$PI/copies_arm.txt"
[ $rc = 0 ] || { log "copies on arm64 FAILED (a device's copy differs from the server's, or an error)"; exit 1; }
if diff "$PI/copies_host.txt" "$PI/copies_arm.txt" >/dev/null; then
  log "copies: arm64 == x86 host, every codec ($(wc -l < "$PI/copies_host.txt") lines)"
else log "copies: arm64 DIFFERS from the x86 host"; diff "$PI/copies_host.txt" "$PI/copies_arm.txt"; exit 1; fi
