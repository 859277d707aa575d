"""Model folders in use: LocalModel against torch, ModelKeeper's choices, reload under load, broken folders,
and ``fedsketch predict``."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from edge_sdk import cli
from edge_sdk.models.artifacts import load_manifest, models_dir
from edge_sdk.models.keeping import KeepPolicy, ModelKeeper
from edge_sdk.models.local_model import LocalModel
from edge_sdk.models.model_folder import (
    ENTRY,
    WEIGHTS,
    ModelEntry,
    ModelFolderError,
    weights_sha256,
    write_model_folder,
)
from edge_sdk.training.evaluation import evaluate, torch_logits

ARCH = "digits_cnn_1x8x8_10"


@pytest.fixture(scope="module")
def template() -> dict[str, np.ndarray]:
    spec = load_manifest()["digits_cnn"]
    return load_file(str(models_dir() / spec.extra["weights"]["file"]))


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    """Samples in [0, 1] whose top two template logits are 1e-4 apart or more (ten times the logits' tolerance),
    so that no argmax can flip on rounding (the untrained template's logits lie close together)."""
    pool = np.random.default_rng(0).random((400, 8, 8), dtype=np.float32)
    spec = load_manifest()["digits_cnn"]
    from edge_sdk.training.evaluation import onnx_classifier

    z = np.sort(onnx_classifier(ARCH, load_file(str(models_dir() / spec.extra["weights"]["file"])))
                .logits(pool.reshape(-1, 1, 8, 8)), axis=1)
    return np.ascontiguousarray(pool[z[:, -1] - z[:, -2] > 1e-4][:80])


def _entry(key: str = "c0", run: str = "r1", **kw) -> ModelEntry:
    return ModelEntry(key=key, architecture=ARCH, input_shape=(1, 8, 8), num_classes=10, run=run, **kw)


def _constant(weights: dict[str, np.ndarray], cls: int) -> dict[str, np.ndarray]:
    """The weights with class ``cls`` favoured by 10 logits: it predicts ``cls`` for every sample."""
    out = {k: v.copy() for k, v in weights.items()}
    out["fc2.bias"][cls] += 10.0
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_local_model_runs_the_folder_as_torch_does(tmp_path, template, x):
    written = write_model_folder(tmp_path / "m", _entry(version=3), template)
    model = LocalModel.load(tmp_path / "m")
    z_torch, _ = torch_logits(ARCH, template, x, np.zeros(len(x), np.int64), 256, "cpu", 1)
    assert len(x) == 80 and model.folder == tmp_path / "m" and model.info == written
    assert np.array_equal(model.predict(x), np.argmax(z_torch, axis=1))
    np.testing.assert_allclose(model.logits(x), z_torch, rtol=0, atol=1e-5)
    p = model.predict_proba(x)
    assert p.shape == (80, 10) and np.allclose(p.sum(axis=1), 1.0) and np.array_equal(p.argmax(1), model.predict(x))
    assert written.files[WEIGHTS] == weights_sha256(template) == hashlib.sha256(
        (tmp_path / "m" / WEIGHTS).read_bytes()).hexdigest()


def _keeper_checks(root: Path, template, x):
    """Offers through a device folder: (first decision, refused decision, latest decision, labels)."""
    write_model_folder(root.parent / "template", _entry(), template)
    y_test = LocalModel.load(root.parent / "template").predict(x)  # the template is right on every sample

    def ev(arch, w):
        return evaluate(arch, w, x, y_test, force_onnx=True).accuracy, len(y_test)

    keeper = ModelKeeper(root)
    first = keeper.offer(_entry(), template, ev)
    assert keeper.current() == first.current and not (root / "previous").exists()
    worse = _constant(template, 0)  # accuracy 0 on labels the template gives (it predicts 3 and 7 here)
    before = _files(keeper.current())
    refused = keeper.offer(_entry("c1", "r2"), worse, ev)
    assert _files(keeper.current()) == before and keeper.current() == first.current
    latest = ModelKeeper(root, KeepPolicy.LATEST).offer(_entry("c1", "r2"), worse, ev)
    return first, refused, latest, worse


def test_keeper_keeps_the_better_model_unless_told_latest(tmp_path, template, x):
    root = tmp_path / "dev"
    first, refused, latest, worse = _keeper_checks(root, template, x)
    assert first.kept_new
    assert first.reason == "kept model c0 of run r1 (accuracy 1.0000 on this device's test split; first model)"
    assert first.current == root / "versions" / "r1-c0"
    assert not refused.kept_new
    assert refused.reason.startswith("kept the previous model (c0 of run r1, accuracy 1.0000")
    assert "the new c1 of run r2 scores 0.0000, worse by more than the margin 0.01" in refused.reason
    assert (refused.new_accuracy, refused.old_accuracy) == (0.0, 1.0)
    assert latest.kept_new and latest.reason.startswith("kept model c1 of run r2 (policy latest; accuracy 0.0000 ")
    assert (root / "current").resolve() == latest.current != first.current
    assert (root / "previous").resolve() == first.current
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["r1-c0", "r2-c1"]
    assert hashlib.sha256((root / "current" / WEIGHTS).read_bytes()).hexdigest() == weights_sha256(worse)
    kept = json.loads((root / "current" / ENTRY).read_text())
    assert (kept["key"], kept["run"], kept["device_accuracy"], kept["device_test_n"]) == ("c1", "r2", 0.0, 80)
    assert np.array_equal(LocalModel.load(root).predict(x), np.zeros(80, np.int64))


def _offer_fails(root: Path, template, worse) -> tuple:
    decision = ModelKeeper(root, KeepPolicy.LATEST).offer(_entry("c2", "r3"), worse, lambda a, w: None)
    return decision.kept_new, decision.reason


def test_keeper_that_cannot_write_keeps_the_model_it_has(tmp_path, template, x):
    root = tmp_path / "dev"
    first, _, latest, worse = _keeper_checks(root, template, x)
    before = _files(root / "current")
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    kept_new, reason = _offer_fails(afile, template, worse)  # mkdir fails under a file, as root too
    assert not kept_new and f"not kept: cannot write in {afile} (" in reason and afile.read_text() == "not a folder"
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:  # a full disk: no file may grow (root included)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, soft[1]))
        kept_new, reason = _offer_fails(root, template, _constant(template, 1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, soft)
        signal.signal(signal.SIGXFSZ, old)
    assert not kept_new and reason.startswith("model c2 of run r3 not kept: cannot write in ") and \
        reason.endswith("(File too large); the kept model stays")
    if os.geteuid() != 0:  # root ignores modes
        os.chmod(root, 0o500)
        try:
            kept_new, reason = _offer_fails(root, template, _constant(template, 1))
        finally:
            os.chmod(root, 0o700)
        assert not kept_new and "cannot write in" in reason
    assert _files(root / "current") == before and (root / "current").resolve() == latest.current
    assert (root / "previous").resolve() == first.current


def test_reload_takes_the_new_current_while_another_thread_predicts(tmp_path, template, x):
    root = tmp_path / "dev"
    keeper = ModelKeeper(root, KeepPolicy.LATEST)
    keeper.offer(_entry(), template, lambda a, w: None)
    model = LocalModel.load(root)
    first = model.predict(x)
    seen, errors, stop = [], [], threading.Event()

    def loop():
        while not stop.is_set():
            try:
                seen.append(model.predict(x))
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                errors.append(e)

    t = threading.Thread(target=loop)
    t.start()
    try:
        assert model.reload() is False
        assert keeper.offer(_entry("c1", "r2"), _constant(template, 0), lambda a, w: None).kept_new
        assert model.reload() is True and model.info.key == "c1"
        n = len(seen)
        while len(seen) < n + 3 and t.is_alive():
            stop.wait(0.01)
    finally:
        stop.set()
        t.join(10)
    assert errors == [] and np.array_equal(seen[0], first) and not np.array_equal(first, np.zeros(80))
    assert np.array_equal(seen[-1], np.zeros(80, np.int64)) and model.folder == keeper.current()
    (keeper.current() / WEIGHTS).write_bytes(b"broken")  # a broken current: the model in use stays
    keeper.offer(_entry("c2", "r3"), _constant(template, 1), lambda a, w: None)
    (keeper.current() / WEIGHTS).write_bytes(b"broken")
    assert model.reload() is False and model.info.key == "c1" and np.array_equal(model.predict(x[:2]), [0, 0])


def _edit_entry(folder: Path, **changes) -> None:
    raw = json.loads((folder / ENTRY).read_text())
    raw.update(changes)
    (folder / ENTRY).write_text(json.dumps(raw))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_broken_folders_are_refused_in_one_line(tmp_path, template):
    def refused(folder: Path) -> str:
        with pytest.raises(ModelFolderError) as e:
            LocalModel.load(folder)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert refused(tmp_path / "nope") == f"{tmp_path / 'nope'}: no such model folder"
    (tmp_path / "empty").mkdir()
    assert "holds no model (neither model.json nor a 'current' model)" in refused(tmp_path / "empty")
    folders = {}
    for name in ("truncated", "changed", "shape", "arch", "nojson"):
        folders[name] = tmp_path / name
        write_model_folder(folders[name], _entry(), template)
    w = folders["truncated"] / WEIGHTS
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    _flip_last_byte(folders["changed"] / WEIGHTS)
    for name in ("truncated", "changed"):
        msg = refused(folders[name])
        assert msg.startswith(f"{folders[name] / WEIGHTS}: sha256 ") and msg.endswith(
            f"... does not match {weights_sha256(template)[:16]}... in model.json (truncated or changed)")
    _edit_entry(folders["shape"], input_shape=[1, 28, 28])
    assert refused(folders["shape"]) == (f"{folders['shape']}: model.json says input [1, 28, 28] and 10 classes, "
                                         f"architecture {ARCH} takes [1, 8, 8] and 10")
    _edit_entry(folders["arch"], architecture="no_such_net")
    assert refused(folders["arch"]).startswith(f"{folders['arch']}: unknown architecture 'no_such_net': no "
                                               "classifier template in ")
    (folders["nojson"] / ENTRY).unlink()  # one being written
    assert refused(folders["nojson"]) == \
        f"{folders['nojson']}: no model.json (not a model folder, or one still being written)"


@pytest.fixture
def digits_npz(tmp_path, template, x):
    """A model folder and an .npz of 80 samples whose labels the model gets right but for 3 (0.9625)."""
    write_model_folder(tmp_path / "m", _entry(version=2), template)
    y = LocalModel.load(tmp_path / "m").predict(x)
    y[:3] = (y[:3] + 1) % 10
    np.savez(tmp_path / "d.npz", x=x, y=y)
    return tmp_path / "m", tmp_path / "d.npz"


def test_fedsketch_predict_prints_and_writes_the_predictions(tmp_path, capsys, digits_npz, x):
    folder, data = digits_npz
    model = LocalModel.load(folder)
    assert cli.main(["predict", "--model", str(folder), "--data", str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"model c0 run r1 architecture {ARCH} folder {folder}"
    assert out[1:-1] == [f"{i} {c}" for i, c in enumerate(model.predict(x))]
    assert out[-1] == "accuracy 0.9625 on 80 samples"
    assert cli.main(["predict", "--model", str(folder), "--data", str(data), "--proba",
                     "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    proba = model.predict_proba(x)
    assert out[1] == "0 " + str(model.predict(x)[0]) + " " + " ".join(f"{p:.4f}" for p in proba[0])
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["model"] == {"key": "c0", "run": "r1", "version": 2, "architecture": ARCH, "folder": str(folder)}
    assert doc["predictions"] == model.predict(x).tolist() and doc["probabilities"] == proba.tolist()
    assert (doc["accuracy"], doc["n"]) == (0.9625, 80)
    np.savez(tmp_path / "nolabels.npz", x=x[:5])
    assert cli.main(["predict", "--model", str(folder), "--data", str(tmp_path / "nolabels.npz"),
                     "--json", str(tmp_path / "q.json")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 6
    doc = json.loads((tmp_path / "q.json").read_text())
    assert (doc["accuracy"], doc["n"], "probabilities" in doc) == (None, 5, False)


def test_fedsketch_predict_errors_are_one_line_and_exit_2(tmp_path, capsys, digits_npz, x):
    folder, data = digits_npz

    def error(model: Path, npz: Path, *more: str) -> str:
        assert cli.main(["predict", "--model", str(model), "--data", str(npz), *more]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("fedsketch predict: error: ")
        return err.strip()[len("fedsketch predict: error: "):]

    def npz(name: str, **arrays) -> Path:
        np.savez(tmp_path / name, **arrays)
        return tmp_path / name

    assert error(folder, tmp_path / "none.npz") == f"{tmp_path / 'none.npz'}: no such file"
    assert error(folder, npz("s.npz", x=np.zeros((5, 7, 7), np.float32))) == \
        f"x has shape (5, 7, 7); model '{ARCH}' expects (n, 1, 8, 8) or (n, 8, 8)"
    bad = x.copy()
    bad[1, 2, 3] = np.nan
    assert error(folder, npz("n.npz", x=bad)) == f"x contains NaN or Inf; model '{ARCH}' expects finite values"
    assert error(folder, npz("r.npz", x=x, y=np.arange(80) % 11)) == \
        "labels must lie in [0, 9] for 'digits_cnn_1x8x8_10', got values in [0, 10]"
    assert error(folder, npz("l.npz", x=x, y=np.zeros(79, np.int64))) == \
        "y has shape (79,); expected (80,), one label per sample of x"
    assert error(folder, data, "--x-key", "images").startswith(f"{data} lacks arrays ['images']; it holds [")
    _flip_last_byte(folder / WEIGHTS)
    assert error(folder, data).endswith("in model.json (truncated or changed)")
    assert error(tmp_path / "nope", data) == f"{tmp_path / 'nope'}: no such model folder"


def test_fedsketch_predict_never_imports_torch(digits_npz):
    folder, data = digits_npz
    code = ("import sys; sys.modules['torch'] = None; from edge_sdk.cli import main; "
            f"rc = main(['predict', '--model', {str(folder)!r}, '--data', {str(data)!r}]); "
            "print('rc', rc, 'torch', sys.modules['torch'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines()[-1] == "rc 0 torch None", done.stderr[-2000:]
