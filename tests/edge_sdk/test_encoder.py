"""ONNX Runtime encoder sessions, shipped artifacts and their manifest, the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_sdk import ArtifactHashError, OnnxEncoder, artifact_path, load_manifest, models_dir
from edge_sdk.cli import main as cli_main
from edge_sdk.models.artifacts import sha256_file

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_ARTIFACTS = {
    "fmnist_fc_encoder": ((784,), 20),
    "fmnist_fc_ae": ((784,), None),
    "digits_encoder": ((64,), 20),
    "digits_ae": ((64,), None),
    "conv_ae_encoder": ((3, 32, 32), 768),
    "conv_ae": ((3, 32, 32), None),
    "lenet5": ((1, 28, 28), None),
    "digits_cnn": ((1, 8, 8), None),
}


def test_manifest_lists_every_artifact_with_its_recipe():
    manifest = load_manifest()
    assert set(EXPECTED_ARTIFACTS) <= set(manifest)
    for name, (shape, latent) in EXPECTED_ARTIFACTS.items():
        spec = manifest[name]
        assert spec.input_shape == shape, name
        if latent is not None:
            assert spec.latent_dim == latent, name
        assert spec.recipe.startswith("fedsketch export "), name
        assert spec.training_data, name


def test_shipped_artifacts_match_their_manifest_hashes():
    d = models_dir()
    for name, spec in load_manifest().items():
        assert sha256_file(d / spec.file) == spec.sha256, name
        weights = (spec.extra or {}).get("weights")
        if weights:
            assert sha256_file(d / weights["file"]) == weights["sha256"], name


def test_tampered_model_is_refused(tmp_path):
    src = models_dir()
    for f in ("manifest.json", "digits_encoder.onnx"):
        shutil.copy(src / f, tmp_path / f)
    with open(tmp_path / "digits_encoder.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactHashError, match="digits_encoder.*has sha256 .* but the manifest expects"):
        OnnxEncoder("digits_encoder", models_dir=tmp_path)
    with pytest.raises(ArtifactHashError, match="manifest expects"):
        OnnxEncoder(tmp_path / "digits_encoder.onnx")
    with pytest.raises(KeyError, match="unknown artifact 'nope'"):
        artifact_path("nope", tmp_path)


def test_encoder_session_matches_manifest_and_batches():
    enc = OnnxEncoder("digits_encoder", batch_size=7)
    assert enc.latent_dim == 20 and enc.input_shape == (64,)
    x = np.random.default_rng(0).random((50, 64), dtype=np.float32)
    z7 = enc.encode(x)
    z_big = OnnxEncoder("digits_encoder", batch_size=1000).encode(x)
    assert z7.shape == (50, 20) and z7.dtype == np.float32
    np.testing.assert_allclose(z7, z_big, atol=1e-6)
    # image-shaped input is accepted and flattened
    np.testing.assert_allclose(enc.encode(x.reshape(50, 8, 8)), z7, atol=1e-6)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (np.zeros((3, 64), dtype=np.uint8), r"floating-point array .* got dtype uint8 \(scale uint8 images"),
        (np.zeros((3, 63), dtype=np.float32), r"shape \(3, 63\); model 'digits_encoder' expects \(n, 64\) or \(n, 8, 8\)"),
        (np.full((3, 64), np.nan, dtype=np.float32), "contains NaN or Inf"),
        (np.full((3, 64), 255.0, dtype=np.float32), r"values span \[255, 255\]; model 'digits_encoder' expects \[0, 1\]"),
    ],
)
def test_encoder_rejects_bad_input(x, message):
    with pytest.raises(ValueError, match=message):
        OnnxEncoder("digits_encoder").encode(x)


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        OnnxEncoder("digits_encoder", batch_size=0)


def test_sketch_path_imports_no_torch():
    code = (
        "import sys, numpy as np\n"
        "from edge_sdk import OnnxEncoder, Sketcher\n"
        "x = np.random.default_rng(0).random((40, 28, 28), dtype=np.float32)\n"
        "s = Sketcher(OnnxEncoder('fmnist_fc_encoder'), 10, 0.1, seed=1).sketch(x, np.arange(40) % 10)\n"
        "import edge_sdk.training.nets, edge_sdk.training.trainer, edge_sdk.client\n"
        "assert edge_sdk.training.nets.BASE_LAYERS\n"
        "print(len(s.bits), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["25", "False"]


def test_cli_info_reports_kernel_and_artifacts(capsys):
    assert cli_main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    from edge_sdk import BACKEND

    assert data["kernel"] == BACKEND
    assert "digits_encoder" in data["artifacts"]
    assert data["fedsketch"]


def test_cli_sketch_on_npz(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "local.npz"
    np.savez(path, x=rng.integers(0, 256, (30, 28, 28), dtype=np.uint8), y=np.arange(30) % 10)
    assert cli_main(["sketch", str(path), "--seed", "3", "--flip-prob", "0.1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_bits"] == 200 and out["bytes"] == 25 and len(out["sketch_hex"]) == 50
    assert cli_main(["sketch", str(path), "--flip-prob", "0.9"]) == 2
    assert "flip_prob must be in [0, 0.5], got 0.9" in capsys.readouterr().err


def test_public_api_is_pinned_and_sorted():
    import edge_sdk

    assert edge_sdk.__all__ == sorted(edge_sdk.__all__)
    assert {"Sketcher", "Sketch", "OnnxEncoder", "MqttTransport", "Message", "LocalWorker"} <= set(edge_sdk.__all__)
    for name in edge_sdk.__all__:
        assert hasattr(edge_sdk, name), name
