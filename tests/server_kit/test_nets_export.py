"""Architectures, ONNX export recipe, shipped artifacts and the IDX reader."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx.external_data_helper import uses_external_data  # noqa: E402

from edge_sdk.models.artifacts import artifact_path, load_manifest, sha256_file  # noqa: E402
from server_kit.data.idx import load_idx_dataset, read_idx  # noqa: E402
from server_kit.export import export_onnx, load_weights, main, save_weights  # noqa: E402
from server_kit.nets import (  # noqa: E402
    ConvAutoencoder,
    EncoderOnly,
    FCAutoencoder,
    LeNet5,
    build_model,
    count_params,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "models"
ATOL = 1e-5


def _max_diff_vs_torch(onnx_path: Path, module, sample_shape, batch_sizes=(1, 7), seed=0) -> float:
    """Largest |onnxruntime - torch| over random [0, 1) batches of the given sizes."""
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    in_name = session.get_inputs()[0].name
    rng = np.random.default_rng(seed)
    worst = 0.0
    module.eval()
    for b in batch_sizes:
        x = rng.random((b, *sample_shape), dtype=np.float32)
        got = session.run(None, {in_name: x})[0]
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        assert got.shape == want.shape
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def _module_for(entry: dict, weights_dir: Path):
    """The torch module an artifact entry was exported from, rebuilt from its safetensors."""
    model = load_weights(weights_dir / entry["weights"]["file"], entry["architecture"])
    return EncoderOnly(model).eval() if entry["role"] == "encoder" else model


# ----------------------------------------------------------------------------- architectures


def test_fc_autoencoder_param_counts():
    ae = FCAutoencoder()
    assert count_params(ae) == 81_304
    assert count_params(ae.encoder) == 40_270
    assert count_params(ae.decoder) == 41_034
    x = torch.rand(5, 784)
    with torch.no_grad():
        assert ae.encode(x).shape == (5, 20)
        x_hat = ae(x)
    assert x_hat.shape == (5, 784)
    assert float(x_hat.min()) >= 0.0 and float(x_hat.max()) <= 1.0


def test_digits_autoencoder_shapes():
    ae = FCAutoencoder(64, 32, 16)
    assert count_params(ae) == 5_264
    assert count_params(ae.encoder) == 2_608
    assert ae.encode(torch.rand(3, 8, 8)).shape == (3, 16)  # images are flattened


def test_conv_autoencoder_param_count_and_shapes():
    ae = ConvAutoencoder()
    assert count_params(ae) == 47_601
    assert count_params(ae.encoder) == 23_868
    assert ae.latent_dim == 768 and ae.latent_shape == (48, 4, 4)
    ae.eval()
    x = torch.rand(2, 3, 32, 32)
    assert ae.encode(x).shape == (2, 768)
    assert ae(x).shape == (2, 3, 32, 32)


def test_lenet5_returns_logits_not_probabilities():
    net = LeNet5()
    assert count_params(net) == 85_822
    torch.manual_seed(0)
    out = net(torch.rand(4, 1, 28, 28))
    assert out.shape == (4, 10)
    sums = out.sum(dim=1)
    assert torch.all((sums - 1.0).abs() > 1e-3), "rows sum to 1: a softmax is inside the model"
    assert bool((out < 0).any())


def test_weights_file_is_byte_reproducible(tmp_path):
    torch.manual_seed(3)
    net = LeNet5()
    for name in ("a", "b", "c"):
        save_weights(net, tmp_path / f"{name}.safetensors", "lenet5_1x28x28_10")
    hashes = {sha256_file(tmp_path / f"{n}.safetensors") for n in ("a", "b", "c")}
    assert len(hashes) == 1
    back = load_weights(tmp_path / "a.safetensors", "lenet5_1x28x28_10")
    for k, v in net.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


def test_build_model_rejects_unknown_name():
    with pytest.raises(KeyError, match="unknown architecture"):
        build_model("resnet1000")


def test_encoder_only_requires_encode():
    with pytest.raises(TypeError, match="no encode"):
        EncoderOnly(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- fresh exports


@pytest.mark.parametrize("which", ["encoder", "autoencoder"])
def test_fresh_fc_export_matches_torch(tmp_path, which):
    torch.manual_seed(1)
    ae = FCAutoencoder().eval()
    module = EncoderOnly(ae) if which == "encoder" else ae
    out_name = "z" if which == "encoder" else "x_hat"
    path = tmp_path / f"{which}.onnx"
    export_onnx(module, path, [784], output_name=out_name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no external data, no temp
    model = onnx.load(str(path), load_external_data=False)
    assert not any(uses_external_data(t) for t in model.graph.initializer)
    assert model.graph.input[0].name == "x" and model.graph.output[0].name == out_name
    assert _max_diff_vs_torch(path, module, [784]) < ATOL


def test_cli_exports_conv_lenet_digits_and_keeps_manifest_entries(tmp_path):
    out = tmp_path / "models"
    assert main(["conv-ae", "--out", str(out)]) == 0
    assert main(["lenet5", "--out", str(out)]) == 0
    assert main(["digits-ae", "--epochs", "1", "--out", str(out)]) == 0

    raw = json.loads((out / "manifest.json").read_text())
    assert raw["format_version"] == 1
    arts = raw["artifacts"]
    assert set(arts) == {"conv_ae_encoder", "conv_ae", "lenet5", "digits_encoder", "digits_ae"}
    assert arts["conv_ae_encoder"]["latent_dim"] == 768
    assert arts["conv_ae_encoder"]["params"] == 23_868
    assert arts["conv_ae"]["params"] == 47_601
    assert arts["lenet5"]["num_classes"] == 10 and arts["lenet5"]["output_name"] == "logits"
    assert arts["digits_encoder"]["latent_dim"] == 20
    assert arts["digits_encoder"]["recipe"].startswith("fedsketch export digits-ae")

    specs = load_manifest(out)  # the edge SDK reads what the recipe writes
    for name, entry in arts.items():
        path, spec = artifact_path(name, out)  # checks the sha256
        assert spec.input_shape == tuple(entry["input_shape"])
        assert sha256_file(out / entry["weights"]["file"]) == entry["weights"]["sha256"]
        module = _module_for(entry, out)
        assert _max_diff_vs_torch(path, module, entry["input_shape"]) < ATOL, name
    assert specs["digits_ae"].output_name == "x_hat"


def test_cli_refuses_bad_data_arguments(tmp_path):
    out = tmp_path / "m"
    assert main(["fmnist-fc-ae", "--out", str(out)]) == 2  # needs --data
    assert main(["all", "--out", str(out)]) == 2  # checked before building anything
    assert main(["conv-ae", "--data", str(tmp_path), "--out", str(out)]) == 2
    assert main(["fmnist-fc-ae", "--data", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert not out.exists()


def test_export_device_option_trains_where_asked_and_the_cpu_gives_the_shipped_bits(tmp_path, capsys):
    from server_kit.export.training import train_autoencoder

    data = np.random.default_rng(0).random((70, 64), dtype=np.float32)
    losses, weights = {}, {}
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    for dev in [None, *devices]:
        torch.manual_seed(0)
        model = build_model("fc_ae_64_48_20")
        kw = {} if dev is None else {"device": dev}
        losses[dev] = train_autoencoder(model, data, epochs=2, seed=0, batch_size=16, **kw)
        weights[dev] = [p.detach().cpu().numpy().tobytes() for p in model.parameters()]
    assert losses["cpu"] == losses[None] and weights["cpu"] == weights[None]  # the default is the CPU, unchanged
    if "cuda" in losses:  # the same batches: the losses agree to float32 rounding
        assert np.allclose(losses["cuda"], losses["cpu"], rtol=1e-4)
    if not torch.cuda.is_available():  # a usage error, before anything is built
        with pytest.raises(SystemExit) as e:
            main(["digits-ae", "--out", str(tmp_path / "m"), "--device", "cuda"])
        assert e.value.code == 2 and not (tmp_path / "m").exists()
        assert "device 'cuda' asked but torch sees no CUDA device" in capsys.readouterr().err


# ----------------------------------------------------------------------------- shipped artifacts


@pytest.fixture(scope="module")
def shipped_manifest() -> dict:
    path = SHIPPED / "manifest.json"
    if not path.is_file():
        pytest.skip("models/manifest.json not built yet (python -m server_kit.export all ...)")
    return json.loads(path.read_text())["artifacts"]


EXPECTED_SHIPPED = {
    "fmnist_fc_encoder": ("encoder", [784], 20, 40_270),
    "fmnist_fc_ae": ("autoencoder", [784], 20, 81_304),
    "digits_encoder": ("encoder", [64], 20, 4_100),
    "digits_ae": ("autoencoder", [64], 20, 8_244),
    "conv_ae_encoder": ("encoder", [3, 32, 32], 768, 23_868),
    "conv_ae": ("autoencoder", [3, 32, 32], 768, 47_601),
    "lenet5": ("classifier", [1, 28, 28], None, 85_822),
    "digits_cnn": ("classifier", [1, 8, 8], None, 13_706),
}


def test_shipped_manifest_lists_every_artifact(shipped_manifest):
    assert set(shipped_manifest) == set(EXPECTED_SHIPPED)
    for name, (role, shape, latent, params) in EXPECTED_SHIPPED.items():
        e = shipped_manifest[name]
        assert (e["role"], e["input_shape"], e.get("latent_dim"), e["params"]) == (
            role,
            shape,
            latent,
            params,
        ), name
        assert e["file"] == f"{name}.onnx"
        assert e["recipe"].startswith("fedsketch export ")
    for name in ("fmnist_fc_encoder", "fmnist_fc_ae"):
        assert 0.0 < shipped_manifest[name]["test_mse"] < 0.02


@pytest.mark.parametrize("name", sorted(EXPECTED_SHIPPED))
def test_shipped_hashes_match(shipped_manifest, name):
    e = shipped_manifest[name]
    assert sha256_file(SHIPPED / e["file"]) == e["sha256"]
    assert sha256_file(SHIPPED / e["weights"]["file"]) == e["weights"]["sha256"]


@pytest.mark.parametrize("name", sorted(EXPECTED_SHIPPED))
def test_shipped_onnx_reproduces_safetensors_weights(shipped_manifest, name):
    e = shipped_manifest[name]
    path = SHIPPED / e["file"]
    model = onnx.load(str(path), load_external_data=False)
    assert not any(uses_external_data(t) for t in model.graph.initializer)
    assert model.graph.output[0].name == e["output_name"]
    module = _module_for(e, SHIPPED)
    assert _max_diff_vs_torch(path, module, e["input_shape"]) < ATOL


# ----------------------------------------------------------------------------- IDX reader


def _idx_bytes(arr: np.ndarray, type_code: int) -> bytes:
    header = struct.pack(">BBBB", 0, 0, type_code, arr.ndim)
    header += struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def test_idx_reads_raw_and_gzip(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3, 4, 5), dtype=np.uint8)
    (tmp_path / "raw").write_bytes(_idx_bytes(images, 0x08))
    (tmp_path / "packed.gz").write_bytes(gzip.compress(_idx_bytes(images, 0x08)))
    for name in ("raw", "packed.gz"):
        got = read_idx(tmp_path / name)
        assert got.dtype == np.uint8 and got.shape == (3, 4, 5)
        np.testing.assert_array_equal(got, images)


def test_idx_reads_big_endian_floats(tmp_path):
    values = np.array([[1.5, -2.25], [3.0e10, 0.0]], dtype=np.float32)
    (tmp_path / "f").write_bytes(_idx_bytes(values, 0x0D))
    got = read_idx(tmp_path / "f")
    assert got.dtype == np.float32 and got.dtype.isnative
    np.testing.assert_array_equal(got, values)


def test_idx_rejects_bad_magic(tmp_path):
    good = _idx_bytes(np.zeros((2, 2), dtype=np.uint8), 0x08)
    (tmp_path / "bad").write_bytes(b"\x08\x03" + good[2:])
    with pytest.raises(ValueError, match="bad IDX magic number"):
        read_idx(tmp_path / "bad")
    (tmp_path / "badtype").write_bytes(b"\x00\x00\x42\x02" + good[4:])
    with pytest.raises(ValueError, match="unknown type code 0x42"):
        read_idx(tmp_path / "badtype")


def test_idx_rejects_truncated_file(tmp_path):
    data = _idx_bytes(np.zeros((4, 28, 28), dtype=np.uint8), 0x08)
    (tmp_path / "short").write_bytes(data[:-10])
    with pytest.raises(
        ValueError,
        match=r"truncated IDX data \(3126 bytes, the header \(4, 28, 28\) declares 3136\)",
    ):
        read_idx(tmp_path / "short")
    (tmp_path / "short.gz").write_bytes(gzip.compress(data[:6]))
    with pytest.raises(ValueError, match="truncated IDX header"):
        read_idx(tmp_path / "short.gz")


def test_load_idx_dataset(tmp_path):
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    labels = np.array([7, 3], dtype=np.uint8)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(images, 0x08)))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(labels, 0x08))
    x, y = load_idx_dataset(tmp_path, "train")
    np.testing.assert_array_equal(x, images)
    np.testing.assert_array_equal(y, labels)
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        load_idx_dataset(tmp_path, "test")
    with pytest.raises(ValueError, match="unknown split"):
        load_idx_dataset(tmp_path, "validation")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(labels[:1], 0x08))
    with pytest.raises(ValueError, match="2 images but 1 labels"):
        load_idx_dataset(tmp_path, "train")
