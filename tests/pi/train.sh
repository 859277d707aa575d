#!/bin/bash
# fedsketch[train] on aarch64 takes the index's CPU build of torch (the environment marker), a local epoch runs
# with one thread on an emulated Pi 4 core, and `fedsketch bench` prints the Figure 6 ratio there.
source "$(dirname "$0")/lib.sh"
WHEEL=$(ls -t "$PI"/dist/fedsketch-*manylinux*aarch64.whl 2>/dev/null | head -n 1)
[ -n "$WHEEL" ] || { log "no wheel: run wheel.sh first"; exit 1; }
cp "$WHEEL" "$R/root/work/"
t0=$(date +%s)
"$INCHROOT" "rm -rf ~/fedsketch-trainw && python3 -m venv ~/fedsketch-trainw && ~/fedsketch-trainw/bin/pip install './$(basename "$WHEEL")[train]'" \
  > "$PI/train_wheel_pip.log" 2>&1 || { log "pip install [train] FAILED"; tail -20 "$PI/train_wheel_pip.log"; exit 1; }
log "installed [train] in $(( $(date +%s) - t0 )) s: $(grep -oE 'torch-[0-9.]+[^ ]*aarch64[^ ]*whl' "$PI/train_wheel_pip.log" | head -n 1); venv $(du -sh "$R/root/fedsketch-trainw" | cut -f1)"
"$INCHROOT" '~/fedsketch-trainw/bin/python -c "import torch; print(\"torch\", torch.__version__, \"cuda build:\", torch.version.cuda)"' 2>&1 | grep -v MIDR
t0=$(date +%s)
"$INCHROOT" '~/fedsketch-trainw/bin/fedsketch bench --encoder fmnist_fc_encoder --arch lenet5_1x28x28_10 --threads 1 --json bench_train.json' \
  > "$PI/bench_train.txt" 2>"$PI/bench_train.err"; rc=$?
grep -v MIDR_EL1 "$PI/bench_train.txt"; cp "$R/root/work/bench_train.json" "$PI/" 2>/dev/null
log "fedsketch bench with torch, one thread: rc=$rc in $(( $(date +%s) - t0 )) s (emulated: ratios, not speeds)"
[ $rc = 0 ]
