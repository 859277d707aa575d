#!/bin/bash
# A service-mode device on the arm64 root without a compiler (the wheel, see wheel.sh) keeps serving through
# two successive runs of an x86 server (Mosquitto, 3 x86 service-mode devices beside it), without a restart,
# then leaves on the server's signed leave (exit 0). Runs after wheel.sh (it uses its overlay root and venv).
source "$(dirname "$0")/lib.sh"
MQ=""
trap '[ -n "$MQ" ] && kill $MQ 2>/dev/null; umount_nogcc' EXIT
mount_nogcc || exit 1
in_nogcc 'test -x /root/fedsketch-wheel/bin/fedsketch-client' || { log "no wheel venv in the overlay: run wheel.sh first"; exit 1; }
OUT=$PI/service; rm -rf "$OUT"; mkdir -p "$OUT"; V=$HOSTVENV/bin
"$V/fedsketch" keygen "$OUT" >/dev/null && cp "$OUT/server.pub" "$NOGCC/root/root/work/server.pub"
PORT=$(free_port); printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n' "$PORT" > "$OUT/mosquitto.conf"
mosquitto -c "$OUT/mosquitto.conf" > "$OUT/mosquitto.log" 2>&1 & MQ=$!
sleep 1; URL=mqtt://127.0.0.1:$PORT
PIDS=()
for i in 0 1 2; do
  "$V/fedsketch-client" --serve --broker $URL --federation pisvc --client-id c0$i --data "$PI/data/c0$i.npz" --seed $i \
    --hello-jitter 0 --server-key "$OUT/server.pub" > "$OUT/c0$i.log" 2>&1 & PIDS+=($!)
done
in_nogcc "rm -rf model-c03; fedsketch-client --serve --broker $URL --federation pisvc --client-id c03 --data data/c03.npz \
  --seed 3 --hello-jitter 0 --server-key server.pub --model-dir model-c03" > "$OUT/c03-arm64.log" 2>&1 & ARM=$!
ok=0
for run in 1 2; do
  t0=$(date +%s)
  timeout 1200 "$V/fedsketch-server" --broker $URL --federation pisvc --strategy fedsketch --min-clients 4 --rounds 1 \
    --architecture digits_cnn_1x8x8_10 --encoder digits_encoder --num-classes 10 --epochs 1 --seed 0 \
    --signing-key "$OUT/server.key" --register-timeout 600 --round-timeout 600 --report-dir "$OUT/run$run" \
    > "$OUT/server$run.log" 2>&1
  rc=$?; log "run $run: server rc=$rc in $(( $(date +%s) - t0 )) s; $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("run", r["run_id"], "assignment", r["assignment"])' "$OUT/run$run/results.json" 2>&1)"
  [ $rc = 0 ] || ok=1
done
kill -0 $ARM 2>/dev/null && log "the arm64 device is still serving after 2 runs" || { log "the arm64 device LEFT"; ok=1; }
"$V/fedsketch-server" --broker $URL --federation pisvc --signing-key "$OUT/server.key" --leave all
wait $ARM; arm_rc=$?; for p in "${PIDS[@]}"; do wait $p; done
# Runs the device joined: each run's assignment names it, and it joined on the run's announcement (once); the first
# run's announcement is not retained, so a device still subscribing then joins that one through the server's hello
# request instead (as tests/server_kit/test_service_mode.py accepts): no announcement line for it.
joined=$(python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
try:
    ids, assigned = [], []
    for run in (1, 2):
        r = json.load(open(f"{out}/run{run}/results.json"))
        ids.append(r["run_id"])
        assigned.append("c03" in (r.get("assignment") or {}))
    text = open(f"{out}/c03-arm64.log", errors="replace").read()
except (OSError, ValueError, KeyError) as e:
    print(0, f"(cannot tell: {e})")
    sys.exit()
announced = [j for j in re.findall(r"the server announces run (\S+): joining it", text) if j in ids]
served = [assigned[i] and (announced.count(run) == 1 or (i == 0 and run not in announced))
          for i, run in enumerate(ids)]
first = "on its announcement" if ids[0] in announced else "through the server's hello request"
print(sum(served), f"(the first {first}; announcements joined {announced} of runs {ids}; "
                   f"the device in each run's assignment: {assigned})")
PY
)
log "arm64 device: exit $arm_rc after the signed leave; runs joined: $joined; log lines:"
grep -v MIDR_EL1 "$OUT/c03-arm64.log" | grep -E "announces run|trained|sketch|assigned|finished|leave|ERROR|Traceback" | cut -c1-200
# The model the arm64 device kept at the end of its last run, predicted with there (ONNX Runtime, no torch) and here
in_nogcc "fedsketch predict --model model-c03 --data data/c03.npz --proba --json pred-arm64.json" \
  > "$OUT/predict-arm64.log" 2>&1; prc=$?
"$V/fedsketch" predict --model "$NOGCC/root/root/work/model-c03" --data "$PI/data/c03.npz" --proba \
  --json "$OUT/pred-x86.json" > "$OUT/predict-x86.log" 2>&1
same=$(python3 - "$NOGCC/root/root/work/pred-arm64.json" "$OUT/pred-x86.json" <<'PY'
import json, sys
try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except (OSError, ValueError) as e:
    print(f"no (cannot read the predictions: {e})")
    sys.exit()
gap = max(abs(x - y) for pa, pb in zip(a["probabilities"], b["probabilities"]) for x, y in zip(pa, pb))
ok = a["predictions"] == b["predictions"] and a["model"]["key"] == b["model"]["key"] and gap < 1e-5
print(("yes" if ok else "no") + f" (model {a['model']['key']} of run {a['model']['run']}; {a['n']} samples, labels "
      f"{'identical' if a['predictions'] == b['predictions'] else 'DIFFERENT'}, largest probability gap {gap:.2e}, "
      f"accuracy {a['accuracy']})")
PY
)
log "the arm64 device's kept model: fedsketch predict there rc=$prc; the same as x86: $same"
[ "$arm_rc" = 0 ] && [ "${joined%% *}" = 2 ] && [ $ok = 0 ] && [ $prc = 0 ] && [ "${same%% *}" = yes ]
