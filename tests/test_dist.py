"""The package as a device installs it: sdist -> wheel -> a fresh venv without torch -> ``fedsketch sketch``.

Also the encoder that ``fedsketch sketch`` picks from the data's shape (in process, fast).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import edge_sdk
import server_kit
from edge_sdk import cli

REPO = Path(__file__).resolve().parents[1]


def _digits_npz(path: Path, n: int = 60) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.random((n, 8, 8), dtype=np.float32), y=np.arange(n) % 10)
    return path


@pytest.mark.parametrize(
    "shape, name",
    [((8, 8), "digits_encoder"), ((64,), "digits_encoder"), ((28, 28), "fmnist_fc_encoder"),
     ((784,), "fmnist_fc_encoder"), ((3, 32, 32), "conv_ae_encoder")],
)
def test_pick_encoder_by_shape(shape, name):
    assert cli.pick_encoder(shape) == name


def test_sketch_picks_the_digits_encoder(tmp_path, capsys):
    data = _digits_npz(tmp_path / "d.npz")
    assert cli.main(["sketch", str(data), "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert (res["encoder"], res["n_bits"], res["bytes"], res["samples"]) == ("digits_encoder", 200, 25, 60)
    assert "encoder digits_encoder" in err and "8x8" in err


def test_sketch_refuses_data_no_encoder_takes(tmp_path, capsys):
    data = tmp_path / "odd.npz"
    np.savez(data, x=np.zeros((4, 5, 5), np.float32), y=np.zeros(4, np.int64))
    assert cli.main(["sketch", str(data)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for text in ("5x5", "digits_encoder (64 or 8x8)", "fmnist_fc_encoder (784 or 28x28)",
                 "conv_ae_encoder (3x32x32)"):
        assert text in lines[0]


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.mark.slow
def test_wheel_installs_and_sketches_without_torch(tmp_path):
    """About 20 s here: sdist 1 s, wheel from it 9 s, venv 3 s, install (dependencies from the index) 5 s."""
    t0 = time.perf_counter()
    dist = tmp_path / "dist"
    # the sdist first (what a Raspberry Pi installs), then the wheel built from it, as `make dist` does;
    # egg-info goes to tmp_path, not into the checkout
    _run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d", str(dist)],
         cwd=REPO)
    (sdist,) = dist.glob("fedsketch-*.tar.gz")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
          str(sdist)], cwd=tmp_path)
    (wheel,) = dist.glob("fedsketch-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("FEDSKETCH_")}
    _run([str(py), "-m", "pip", "install", "-q", str(wheel)], env=env, cwd=tmp_path)  # edge profile only

    no_torch = subprocess.run([str(py), "-c", "import torch"], capture_output=True, text=True, env=env,
                              cwd=tmp_path)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    where = _run([str(py), "-c", "import edge_sdk, edge_sdk.bits as b; print(edge_sdk.__file__, b.BACKEND)"],
                 env=env, cwd=tmp_path).stdout.split()
    assert Path(where[0]).is_relative_to(venv), where  # the installed copy, not the checkout
    assert where[1] == "cython", where

    info = _run([str(venv / "bin" / "fedsketch"), "info"], env=env, cwd=tmp_path).stdout
    rows = dict(line.split(None, 1) for line in info.splitlines() if line.strip())
    assert (rows["kernel"], rows["torch"]) == ("cython", "not installed"), info
    assert Path(rows["models_dir"]).is_relative_to(venv), info  # the wheel carries the ONNX artifacts
    # every public name of edge_sdk imports without torch; server_kit's face is importable (lazy, no torch)
    faces = _faces(py, ["edge_sdk"], env, tmp_path)
    assert faces == {"edge_sdk": len(edge_sdk.__all__)}
    lazy = _run([str(py), "-c", "import server_kit, sys; print(len(server_kit.__all__), 'torch' in sys.modules)"],
                env=env, cwd=tmp_path).stdout.split()
    assert lazy == [str(len(server_kit.__all__)), "False"], lazy

    data = _digits_npz(tmp_path / "local.npz")
    res = _run([str(venv / "bin" / "fedsketch"), "sketch", str(data), "--seed", "1"], env=env, cwd=tmp_path)
    out = json.loads(res.stdout)
    assert (out["encoder"], out["n_bits"], out["bytes"], out["samples"]) == ("digits_encoder", 200, 25, 60)
    assert len(bytes.fromhex(out["sketch_hex"])) == 25
    assert "encoder digits_encoder" in res.stderr
    # each step has its own 300 s limit (_run); the total is reported, not asserted
    print(f"sdist, wheel, venv, install and sketch: {time.perf_counter() - t0:.1f} s")

    # the server's public names need torch and the server extra: this venv has them, so import each one
    # from the wheel's own files (unpacked and put first on the path) to show the wheel holds every module
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    env_dev = dict(env, PYTHONPATH=str(unpacked))
    faces = _faces(Path(sys.executable), ["edge_sdk", "server_kit"], env_dev, tmp_path, root=unpacked)
    assert faces == {"edge_sdk": len(edge_sdk.__all__), "server_kit": len(server_kit.__all__)}


def _faces(py: Path, packages: list[str], env: dict[str, str], cwd: Path, root: Path | None = None) -> dict:
    """Import every name of each package's ``__all__`` with ``py``; the packages must load from ``root``
    (default: ``cwd``'s venv), not from the checkout. Returns {package: number of names imported}."""
    code = ("import importlib, json, sys\n"
            "out = {}\n"
            f"for name in {packages!r}:\n"
            "    pkg = importlib.import_module(name)\n"
            "    for n in pkg.__all__: getattr(pkg, n)\n"
            "    out[name] = [len(pkg.__all__), pkg.__file__]\n"
            "print(json.dumps(out))\n")
    out = json.loads(_run([str(py), "-c", code], env=env, cwd=cwd).stdout)
    base = root if root is not None else cwd / "venv"
    for name, (_, where) in out.items():
        assert Path(where).is_relative_to(base), (name, where)  # the installed copy, not the checkout
    return {name: n for name, (n, _) in out.items()}


def test_wheel_lists_every_package():
    """setup.py finds every package under edge_sdk/ and server_kit/: a folder left out would be missing."""
    import setuptools

    found = set(setuptools.find_packages(str(REPO), include=["edge_sdk", "edge_sdk.*", "server_kit", "server_kit.*"]))
    on_disk = {str(p.parent.relative_to(REPO)).replace("/", ".")
               for root in ("edge_sdk", "server_kit") for p in (REPO / root).rglob("__init__.py")}
    assert on_disk and on_disk == found
