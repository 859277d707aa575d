#!/bin/bash
# `fedsketch predict` on the arm64 plain install (pi_check's ~/fedsketch: no torch, ONNX Runtime only) gives the
# x86 host's labels, and its probabilities within 1e-5: a model folder (the digits_cnn template's weights,
# perturbed with seed 0) and 200 sklearn digits are written on the host, predicted in the chroot and on the host.
source "$(dirname "$0")/lib.sh"
W=$R/root/work
[ -d "$W" ] || { log "no $W: run pi_check.sh first"; exit 1; }
rm -rf "$W/predict_model" "$W/predict_digits.npz" "$W/pred_arm.json" "$PI/pred_arm.json" "$PI/pred_host.json"
"$HOSTVENV/bin/python" - "$W" > "$PI/predict_write.log" 2>&1 <<'PY' || { log "writing the model folder and the digits FAILED"; cat "$PI/predict_write.log"; exit 1; }
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from sklearn.datasets import load_digits

from edge_sdk.models.artifacts import load_manifest, models_dir
from edge_sdk.models.model_folder import ModelEntry, weights_sha256, write_model_folder

out = Path(sys.argv[1])
spec = load_manifest()["digits_cnn"]
template = load_file(str(models_dir() / spec.extra["weights"]["file"]))
rng = np.random.default_rng(0)
weights = {k: (template[k] + 0.05 * rng.standard_normal(template[k].shape)).astype(template[k].dtype)
           for k in sorted(template)}
assert weights_sha256(weights) != weights_sha256(template)
entry = ModelEntry(key="c0", architecture=spec.extra["architecture"], input_shape=tuple(spec.input_shape),
                   num_classes=int(spec.num_classes), run="pi-predict", version=1)
written = write_model_folder(out / "predict_model", entry, weights)
x, y = load_digits(return_X_y=True)
np.savez(out / "predict_digits.npz", x=(x[:200] / 16.0).astype(np.float32).reshape(-1, 8, 8), y=y[:200].astype(np.int64))
print("model folder", out / "predict_model", "weights sha256", written.files["weights.safetensors"])
PY
log "$(cat "$PI/predict_write.log")"
"$INCHROOT" 'pip show torch' >/dev/null 2>&1 && { log "torch is installed in the chroot's plain venv: not the torch-less case"; exit 1; }
t0=$(date +%s)
"$INCHROOT" 'fedsketch predict --model predict_model --data predict_digits.npz --json pred_arm.json --proba' \
  > "$PI/predict_arm.txt" 2>"$PI/predict_arm.err"; arm_rc=$?
log "arm64 fedsketch predict: rc=$arm_rc in $(( $(date +%s) - t0 )) s; $(head -n 1 "$PI/predict_arm.txt"); $(tail -n 1 "$PI/predict_arm.txt")"
if [ $arm_rc != 0 ]; then
  grep -v MIDR_EL1 "$PI/predict_arm.err" | tail -5
  grep -q "invalid choice: 'predict'" "$PI/predict_arm.err" && \
    log "the chroot's install has no fedsketch predict: its sdist is built from git ls-files (commit, then rerun pi_check)"
  exit 1
fi
cp "$W/pred_arm.json" "$PI/pred_arm.json" || exit 1
(cd "$W" && "$HOSTVENV/bin/fedsketch" predict --model predict_model --data predict_digits.npz --json "$PI/pred_host.json" \
  --proba) > "$PI/predict_host.txt" 2>"$PI/predict_host.err" || { log "host fedsketch predict FAILED"; cat "$PI/predict_host.err"; exit 1; }
"$HOSTVENV/bin/python" - "$PI/pred_arm.json" "$PI/pred_host.json" <<'PY'
import json
import sys

import numpy as np

arm, host = (json.load(open(p)) for p in sys.argv[1:3])
bad = []
same = {k: v for k, v in arm["model"].items() if k != "folder"} == {k: v for k, v in host["model"].items() if k != "folder"}
if not same:
    bad.append(f"model {arm['model']} != {host['model']}")
if arm["n"] != 200 or host["n"] != 200:
    bad.append(f"samples: arm64 {arm['n']}, host {host['n']} (200 written)")
labels = sum(a != h for a, h in zip(arm["predictions"], host["predictions"]))
if labels or len(arm["predictions"]) != len(host["predictions"]):
    bad.append(f"{labels} labels differ")
pa, ph = np.asarray(arm["probabilities"]), np.asarray(host["probabilities"])
gap = float(np.abs(pa - ph).max()) if pa.shape == ph.shape else float("inf")
if gap > 1e-5:
    bad.append(f"probabilities differ by up to {gap:.3g} (shapes {pa.shape}, {ph.shape})")
if arm["accuracy"] != host["accuracy"]:
    bad.append(f"accuracy arm64 {arm['accuracy']}, host {host['accuracy']}")
print(f"arm64 against x86 host: {len(arm['predictions'])} labels, {labels} differ; probabilities within {gap:.2g}; "
      f"accuracy {arm['accuracy']} and {host['accuracy']}" + ("; MISMATCH: " + "; ".join(bad) if bad else ""))
sys.exit(1 if bad else 0)
PY
rc=$?
log "fedsketch predict, arm64 against the host: $([ $rc = 0 ] && echo identical labels, probabilities within 1e-5 || echo MISMATCH)"
[ $rc = 0 ]
