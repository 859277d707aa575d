#!/bin/bash
# The Pi wheel: built under emulation (deploy/pi/build_wheel_aarch64.sh, in pi_check's arm64 root), then
# installed in an arm64 root WITHOUT a compiler or Python headers: `fedsketch info` must say kernel cython,
# its 45 sketches must be bit-identical to the x86 host's, and `fedsketch bench` must print its table and JSON.
source "$(dirname "$0")/lib.sh"
trap umount_nogcc EXIT
ARM_ROOT=$R bash "$SRC/deploy/pi/build_wheel_aarch64.sh" "$(ls -t "$PI"/dist/fedsketch-*.tar.gz | head -n 1)" "$PI/dist" \
  > "$PI/wheel_build.log" 2>&1 || { log "wheel build FAILED (see $PI/wheel_build.log)"; tail -20 "$PI/wheel_build.log"; exit 1; }
WHEEL=$(ls -t "$PI"/dist/fedsketch-*manylinux*aarch64.whl | head -n 1)
log "wheel: $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB); $(grep -E '^\S+ is consistent|manylinux' "$PI/wheel_build.log" | head -n 2 | tr '\n' ' ')"
mount_nogcc fresh || { log "overlay mount failed"; exit 1; }
log "removing the compiler and the Python headers from the overlay"
in_nogcc 'DEBIAN_FRONTEND=noninteractive apt-get purge -y -q gcc-12 cpp-12 libpython3.11-dev python3.11-dev >/dev/null 2>&1; \
  echo "gcc: $(command -v gcc cc || echo none); Python.h: $(ls /usr/include/python3.11/Python.h 2>/dev/null || echo none)"'
in_nogcc 'command -v gcc cc' >/dev/null && { log "a compiler is still there"; exit 1; }
mkdir -p "$NOGCC/root/root/work/data"; cp "$WHEEL" "$NOGCC/root/root/work/"; cp "$PI"/data/*.npz "$NOGCC/root/root/work/data/"
cp "$PI/compare_sketch.py" "$NOGCC/root/root/work/"
t0=$(date +%s)
in_nogcc "python3 -m venv /root/fedsketch-wheel && /root/fedsketch-wheel/bin/pip install -q --only-binary :all: ./$(basename "$WHEEL")" \
  > "$PI/wheel_install.log" 2>&1 || { log "pip install of the wheel FAILED"; tail -20 "$PI/wheel_install.log"; exit 1; }
log "installed without a compiler in $(( $(date +%s) - t0 )) s"
in_nogcc 'fedsketch info' | tee "$PI/info_wheel.txt"
grep -q "^kernel *cython" "$PI/info_wheel.txt" || { log "the wheel's kernel is NOT cython"; exit 1; }
in_nogcc 'python compare_sketch.py data' > "$PI/cmp_wheel_cython.txt"
if diff <(tail -n +2 "$PI/cmp_host_cython.txt") <(tail -n +2 "$PI/cmp_wheel_cython.txt") >/dev/null; then
  log "grid of 45 sketches + latents: wheel on arm64 == x86 host cython ($(head -n 1 "$PI/cmp_wheel_cython.txt"))"
else log "grid: the wheel's sketches DIFFER from the x86 host's"; exit 1; fi
t0=$(date +%s)
in_nogcc 'fedsketch bench --json bench.json' > "$PI/bench_wheel.txt" 2>"$PI/bench_wheel.err"; rc=$?
cat "$PI/bench_wheel.txt"; cp "$NOGCC/root/root/work/bench.json" "$PI/bench_wheel.json" 2>/dev/null
log "fedsketch bench (no torch) rc=$rc in $(( $(date +%s) - t0 )) s (emulated Cortex-A72: not the speed of a Pi)"
[ $rc = 0 ] && tail -n 1 "$PI/bench_wheel.txt" | python3 -c 'import json,sys; json.loads(sys.stdin.read())' || exit 1
