"""``fedsketch-data split`` and the ``server_kit.data`` exports: data sets into client files."""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import server_kit.data as data
from server_kit.data import idx, load_client, partition
from server_kit.data.split import load_source, main

ROOT = Path(__file__).resolve().parents[2]


def _run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _error(argv, capsys) -> str:
    """Run a bad command: exit code 2 and exactly one ``fedsketch-data: error:`` line, no traceback."""
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("fedsketch-data")]
    assert len(lines) == 1 and lines[0].startswith("fedsketch-data: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _truth(out: Path) -> dict[str, int]:
    return json.loads((out / "truth.json").read_text())


def _idx_bytes(arr: np.ndarray) -> bytes:
    """``arr`` (uint8) in the IDX format: magic ``00 00 08 ndim``, big-endian uint32 sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def _write_idx(folder: Path, n: int, *, split: str = "train", gz: bool = False, seed: int = 0):
    """A tiny MNIST-style folder of 28x28 uint8 images and labels 0..9.

    Uncompressed files have no published hash, so the loader reads them with a
    logged warning; ``.gz`` files are checked against the real MNIST hashes
    and so fail (that is what the checksum test wants).
    """
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % 10).astype(np.uint8)
    img_stem, lbl_stem = idx.IDX_FILES[split]
    ext, pack = (".gz", gzip.compress) if gz else ("", lambda b: b)
    (folder / (img_stem + ext)).write_bytes(pack(_idx_bytes(images)))
    (folder / (lbl_stem + ext)).write_bytes(pack(_idx_bytes(labels)))
    return images, labels


# ----------------------------------------------------------------------------- exports


def test_server_kit_data_exports_loaders_and_partitioners():
    assert data.__all__ == sorted(data.__all__)
    assert set(data.__all__) == set(idx.__all__) | set(partition.__all__)
    for name in data.__all__:
        assert getattr(data, name) is (getattr(idx, name) if name in idx.__all__ else getattr(partition, name))
    from server_kit.data import load_fashion_mnist, load_mnist, rotation_groups  # noqa: F401 - the issue's import


def test_importing_server_kit_data_and_split_stays_light():
    code = ("import sys, server_kit.data, server_kit.data.split; "
            "print(sorted(m for m in ('torch', 'sklearn', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- splits


def test_digits_into_8_clients_in_4_rotation_groups(tmp_path, capsys):
    out = tmp_path / "clients"
    code, stdout, _ = _run(["split", "--clients", 8, "--groups", 4, "--out", out], capsys)
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == [f"c{i:02d}.npz" for i in range(8)] + ["truth.json"]
    truth = _truth(out)
    assert truth == {f"c{i:02d}": i % 4 for i in range(8)}
    total = 0
    for cid, group in truth.items():
        c = load_client(out / f"{cid}.npz")
        assert c.cid == cid and c.group == group
        assert c.x_train.shape[1:] == (8, 8) and c.x_test.shape[1:] == (8, 8)
        assert c.x_train.dtype == np.float32 and c.y_train.dtype == np.int64
        assert 0.0 <= c.x_train.min() and c.x_train.max() <= 1.0
        assert len(c.y_test) == 45 and len(c.y_train) in (179, 180)
        total += len(c.y_train) + len(c.y_test)
    assert total == 1797
    with np.load(out / "c03.npz", allow_pickle=False) as f:  # what fedsketch-client reads
        assert {"x", "y", "x_test", "y_test"} <= set(f.files)
    assert "8 clients in 4 groups" in stdout and "8x8 images" in stdout
    assert "samples per client: 224-225 (train 179-180, test 45)" in stdout
    assert "group 1 (rotated 90 degrees): 2 clients: c01 c05" in stdout
    assert "fedsketch-server --broker mqtt://127.0.0.1:1883" in stdout and "--min-clients 8" in stdout
    assert "the server picks digits_encoder and digits_cnn_1x8x8_10 for these 8x8 samples" in stdout
    assert "--encoder" not in stdout and "--architecture" not in stdout
    assert f'for f in {out}/*.npz; do fedsketch-client' in stdout


def test_npz_source_with_label_flip_groups(tmp_path, capsys):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(240, 28, 28), dtype=np.uint8)
    y = np.arange(240) % 10
    src = tmp_path / "local.npz"
    np.savez(src, x=x, y=y, x_test=x[:40], y_test=y[:40])
    out = tmp_path / "flip"
    code, stdout, _ = _run(["split", "--source", src, "--partition", "label-flip", "--clients", 8,
                            "--groups", 4, "--seed", 3, "--out", out], capsys)
    assert code == 0
    truth = _truth(out)
    assert truth == {f"c{i:02d}": i % 4 for i in range(8)}
    lookup = {img.tobytes(): int(label) for img, label in zip(x, y)}
    seen = 0
    for cid, group in truth.items():
        c = load_client(out / f"{cid}.npz")
        assert c.x_train.shape[1:] == (28, 28) and c.x_train.dtype == np.float32
        for xs, ys in ((c.x_train, c.y_train), (c.x_test, c.y_test)):
            for img, label in zip(xs, ys):  # images unchanged (x / 255), labels shifted by -group
                original = lookup[np.rint(img * 255).astype(np.uint8).tobytes()]
                assert label == (original - group) % 10
                seen += 1
    assert seen == 240  # --split train (the default) leaves x_test, y_test of the source out
    assert "label-flip" in stdout and "28x28 images" in stdout and "labels y -> (y - 3) mod 10" in stdout
    assert "the server picks fmnist_fc_encoder and lenet5_1x28x28_10 for these 28x28 samples" in stdout

    code, stdout, _ = _run(["split", "--source", f"npz:{src}", "--split", "all", "--partition",
                            "label-flip", "--clients", 8, "--out", out, "--overwrite"], capsys)
    assert code == 0 and "280 samples (all)" in stdout


def test_idx_folder_source(tmp_path, capsys, caplog):
    folder = tmp_path / "mnist"
    _write_idx(folder, 120)
    _write_idx(folder, 30, split="test", seed=1)
    out = tmp_path / "clients"
    code, stdout, _ = _run(["split", "--source", f"mnist:{folder}", "--clients", 6, "--groups", 3,
                            "--min-size", 5, "--out", out], capsys)
    assert code == 0
    assert _truth(out) == {f"c{i:02d}": i % 3 for i in range(6)}
    c = load_client(out / "c01.npz")
    assert c.x_train.shape == (16, 28, 28) and c.x_test.shape == (4, 28, 28)
    assert "checksum not verified" in caplog.text  # raw files have no published hash: read, with a warning
    assert "120 samples (train)" in stdout and "28x28 images" in stdout

    # the parent folder of mnist/ works too, and --split all reads both splits
    code, stdout, _ = _run(["split", "--source", f"mnist:{tmp_path}", "--split", "all", "--clients", 6,
                            "--groups", 3, "--out", out, "--overwrite"], capsys)
    assert code == 0 and "150 samples (all)" in stdout
    # any MNIST-style folder, and a seeded subset
    s = load_source(f"idx:{folder}", max_samples=50, seed=2)
    assert s.x.shape == (50, 28, 28) and s.x.dtype == np.float32 and s.y.dtype == np.int64


def test_other_partitions(tmp_path, capsys):
    cases = {
        "uneven": ([], {"c00": 0, "c01": 1, "c02": 1, "c03": 2, "c04": 2, "c05": 2, "c06": 3,
                        "c07": 3, "c08": 3, "c09": 3}),
        "dirichlet": (["--alpha", "1"], {f"c{i:02d}": 0 for i in range(10)}),
        "class-sets": ([], {f"c{i:02d}": i % 3 for i in range(10)}),
        "ocfl": (["--ocfl-split", "nonoverlap_imbalanced"],
                 dict(zip([f"c{i:02d}" for i in range(10)], [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]))),
        "pathological": (["--class-sets", "0,1/2,3,4/5,6,7,8,9"], {f"c{i:02d}": i % 3 for i in range(10)}),
    }
    for name, (extra, truth) in cases.items():
        out = tmp_path / name
        code, stdout, err = _run(["split", "--partition", name, "--clients", 10, *extra, "--out", out], capsys)
        assert code == 0, (name, err)
        assert _truth(out) == truth, name
    c = load_client(tmp_path / "class-sets" / "c01.npz")
    assert set(np.unique(np.concatenate([c.y_train, c.y_test]))) == {4, 5, 6}


def test_overwrite_removes_stale_clients(tmp_path, capsys):
    out = tmp_path / "o"
    assert _run(["split", "--clients", 8, "--out", out], capsys)[0] == 0
    assert "already holds c00.npz, c01.npz, c02.npz, ..." in _error(["split", "--clients", 4, "--out", out], capsys)
    assert _run(["split", "--clients", 4, "--out", out, "--overwrite"], capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["c00.npz", "c01.npz", "c02.npz", "c03.npz", "truth.json"]


# ----------------------------------------------------------------------------- errors


def test_missing_folder(tmp_path, capsys):
    line = _error(["split", "--source", f"mnist:{tmp_path / 'nope'}", "--out", tmp_path / "o"], capsys)
    assert line == f"fedsketch-data: error: --source mnist:{tmp_path / 'nope'}: no such folder"
    line = _error(["split", "--source", f"fashion-mnist:{tmp_path}", "--out", tmp_path / "o"], capsys)
    assert "neither train-images-idx3-ubyte.gz nor train-images-idx3-ubyte found" in line
    assert not (tmp_path / "o").exists()


def test_unknown_partition_and_source(tmp_path, capsys):
    line = _error(["split", "--partition", "spiral", "--out", tmp_path], capsys)
    assert "argument --partition: invalid choice: 'spiral'" in line and "rotation" in line
    line = _error(["split", "--source", "cifar:/data", "--out", tmp_path], capsys)
    assert line.endswith("--source must be digits, mnist:DIR, fashion-mnist:DIR, idx:DIR, or an .npz "
                         "file (PATH.npz or npz:PATH); got 'cifar:/data'")


def test_fewer_clients_than_groups(tmp_path, capsys):
    line = _error(["split", "--clients", 3, "--groups", 4, "--out", tmp_path / "o"], capsys)
    assert line.endswith("--clients 3 is fewer than the 4 groups of --partition rotation: "
                         "every group needs at least one client")
    line = _error(["split", "--partition", "ocfl", "--clients", 2, "--out", tmp_path / "o"], capsys)
    assert "--clients 2 is fewer than the 3 groups of --partition ocfl" in line


def test_npz_without_x_or_y(tmp_path, capsys):
    src = tmp_path / "bad.npz"
    np.savez(src, images=np.zeros((10, 4, 4)), y=np.zeros(10, dtype=np.int64))
    line = _error(["split", "--source", src, "--out", tmp_path / "o"], capsys)
    assert line == (f"fedsketch-data: error: {src} has no 'x' array: an .npz source needs x and y "
                    "(optionally x_test and y_test); it has ['images', 'y']")
    with pytest.raises(ValueError, match=r"has no 'x' array: an \.npz source needs x and y"):
        load_source(str(src))
    pickled = tmp_path / "objects.npz"
    np.savez(pickled, x=np.array([None] * 3, dtype=object), y=np.zeros(3, dtype=np.int64))
    assert "cannot read" in _error(["split", "--source", pickled, "--out", tmp_path / "o"], capsys)
    floats = tmp_path / "floaty.npz"
    np.savez(floats, x=np.zeros((10, 4, 4)), y=np.zeros(10))
    assert "y must be a 1-D array of integer labels, got float64 (10,)" in _error(
        ["split", "--source", floats, "--out", tmp_path / "o"], capsys)


def test_checksum_mismatch_and_verify_no(tmp_path, capsys):
    folder = tmp_path / "mnist"
    _write_idx(folder, 60, gz=True)
    line = _error(["split", "--source", f"mnist:{folder}", "--clients", 4, "--out", tmp_path / "o"], capsys)
    assert "sha256 mismatch for MNIST train-images-idx3-ubyte.gz" in line
    code, _, _ = _run(["split", "--source", f"mnist:{folder}", "--verify", "no", "--clients", 4,
                       "--min-size", 5, "--out", tmp_path / "o"], capsys)
    assert code == 0


def test_options_that_do_not_apply_and_bad_values(tmp_path, capsys):
    line = _error(["split", "--alpha", "0.5", "--partition", "ocfl", "--out", tmp_path], capsys)
    assert line.endswith("--alpha does not apply to --partition ocfl; it applies to rotation, label-flip, "
                         "uneven, dirichlet, class-sets")
    assert "--test-fraction: expected a number in [0, 1), got 1.0" in _error(
        ["split", "--test-fraction", "1", "--out", tmp_path], capsys)
    assert "groups must be between 1 and 4 rotations, got 5" in _error(
        ["split", "--groups", "5", "--out", tmp_path / "o"], capsys)
    assert "--split test: digits has no separate test split" in _error(
        ["split", "--split", "test", "--out", tmp_path / "o"], capsys)


def test_help_shows_defaults_and_choices(capsys):
    assert main(["split", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for part in ("usage: fedsketch-data split", "(default: digits)", "(default: rotation)",
                 "{rotation,label-flip,uneven,dirichlet,class-sets,ocfl,pathological}",
                 "(default: 20)", "(default: 0.2)", "(default: 0)", "{train,test,all}", "{yes,no,strict}",
                 "(default: 4)", "mnist:DIR"):
        assert part in text, part
    assert "(default: None)" not in text


# ----------------------------------------------------------------------------- the command


def test_console_script_runs_as_a_module(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "server_kit.data.split", "split", "--clients", "4", "--out", str(tmp_path / "c")]
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "4 clients in 4 groups" in ok.stdout and "fedsketch-client" in ok.stdout
    assert _truth(tmp_path / "c") == {"c00": 0, "c01": 1, "c02": 2, "c03": 3}
    bad = subprocess.run(cmd[:3] + ["--partition", "nope", "--out", "x"], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "fedsketch-data: error: argument --partition" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert '"fedsketch-data=server_kit.data.split:main"' in (ROOT / "setup.py").read_text()
