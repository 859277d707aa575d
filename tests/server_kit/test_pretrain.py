"""Federated autoencoder pre-training, its byte count, the encoder export, local AE training."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from edge_sdk import OnnxEncoder  # noqa: E402
from edge_sdk.models.artifacts import ArtifactHashError, sha256_file  # noqa: E402
from edge_sdk.protocol import Kind, Message, encode_message, tensors_body  # noqa: E402
from edge_sdk.training.trainer import initial_weights, train_autoencoder_local  # noqa: E402
from server_kit.pretrain import (  # noqa: E402
    FEDERATION,
    MODEL_KEY,
    SERVER_ID,
    client_ids,
    export_encoder,
    federated_ae_pretrain,
    model_message,
    update_message,
)

ARCH = "fc_ae_64_48_20"
ROUNDS, PER_ROUND, N_CLIENT = 2, 3, 400


@pytest.fixture(scope="module")
def digits():
    """scikit-learn digits as float32 (1797, 8, 8) in [0, 1]."""
    datasets = pytest.importorskip("sklearn.datasets")
    return (datasets.load_digits().images / 16.0).astype(np.float32)


@pytest.fixture(scope="module")
def clients(digits):
    """Three clients of 400 digits each (equal sizes: equal envelopes)."""
    order = np.random.default_rng(0).permutation(len(digits))[: 3 * N_CLIENT]
    return [digits[idx] for idx in order.reshape(3, N_CLIENT)]


@pytest.fixture(scope="module")
def pretrained(clients):
    return federated_ae_pretrain(
        clients, architecture=ARCH, rounds=ROUNDS, clients_per_round=PER_ROUND, epochs=3, seed=0
    )


def _mse(weights, x):
    import torch

    from server_kit.nets import build_model

    model = build_model(ARCH)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
    model.eval()
    with torch.no_grad():
        flat = torch.from_numpy(x.reshape(len(x), -1))
        return float(((model(flat) - flat) ** 2).mean())


def test_pretraining_lowers_reconstruction_mse(digits, pretrained):
    before = _mse(initial_weights(ARCH, 0), digits)
    after = _mse(pretrained.weights, digits)
    assert after < 0.7 * before, (before, after)
    assert len(pretrained.history) == ROUNDS
    assert [h["round"] for h in pretrained.history] == [1, 2]
    assert all(len(h["clients"]) == PER_ROUND for h in pretrained.history)
    assert pretrained.history[1]["loss"] < pretrained.history[0]["loss"]
    assert pretrained.seconds > 0
    for k, v in initial_weights(ARCH, 0).items():
        assert pretrained.weights[k].shape == v.shape
        assert pretrained.weights[k].dtype == np.float32


def test_bytes_are_the_wire_envelopes_exactly(pretrained):
    w0 = initial_weights(ARCH, 0)
    model_len = len(model_message(w0, 1))
    update_len = len(update_message(w0, "c00", 1, N_CLIENT))
    # the helpers are the protocol's own encoding of MODEL / UPDATE envelopes
    assert model_len == len(
        encode_message(
            Message(Kind.MODEL, FEDERATION, SERVER_ID, round=7, meta={"key": MODEL_KEY},
                    body=tensors_body(w0))
        )
    )
    assert update_len == len(
        encode_message(
            Message(Kind.UPDATE, FEDERATION, "c02", round=7,
                    meta={"model_key": MODEL_KEY, "n_samples": N_CLIENT}, body=tensors_body(w0))
        )
    )
    assert pretrained.bytes_down == ROUNDS * PER_ROUND * model_len
    assert pretrained.bytes_up == ROUNDS * PER_ROUND * update_len
    assert pretrained.bytes_total == ROUNDS * PER_ROUND * (model_len + update_len)
    assert sum(h["bytes_down"] for h in pretrained.history) == pretrained.bytes_down
    assert sum(h["bytes_up"] for h in pretrained.history) == pretrained.bytes_up
    n_values = sum(v.size for v in w0.values())
    assert model_len > 4 * n_values  # float32 tensors plus headers


def test_pretraining_is_seeded(clients, pretrained):
    again = federated_ae_pretrain(
        clients, architecture=ARCH, rounds=1, clients_per_round=2, epochs=1, seed=3
    )
    twice = federated_ae_pretrain(
        clients, architecture=ARCH, rounds=1, clients_per_round=2, epochs=1, seed=3
    )
    assert again.history[0]["clients"] == twice.history[0]["clients"]
    for k in again.weights:
        np.testing.assert_array_equal(again.weights[k], twice.weights[k])
    # the very clients seed 3 picks (2 of the 3); another seed picks others and trains other weights
    other = federated_ae_pretrain(clients, architecture=ARCH, rounds=1, clients_per_round=2, epochs=1, seed=4)
    assert again.history[0]["clients"] == ["c00", "c01"] and other.history[0]["clients"] == ["c01", "c02"]
    assert not np.array_equal(again.weights["encoder.0.weight"], other.weights["encoder.0.weight"])


def test_pretraining_rejects_bad_settings(clients):
    with pytest.raises(ValueError, match="client_images is empty"):
        federated_ae_pretrain([], architecture=ARCH)
    with pytest.raises(ValueError, match=r"clients_per_round \(4\) exceeds the number of clients \(3\)"):
        federated_ae_pretrain(clients, architecture=ARCH, clients_per_round=4)
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        federated_ae_pretrain(clients, architecture=ARCH, rounds=0, clients_per_round=1)
    with pytest.raises(ValueError, match="lr must be a positive finite number"):
        federated_ae_pretrain(clients, architecture=ARCH, clients_per_round=1, lr=0.0)
    with pytest.raises(ValueError, match=r"client_images\[1\] must be an array of at least one image"):
        federated_ae_pretrain([clients[0], clients[1][:0]], architecture=ARCH, clients_per_round=1)


def test_client_ids_share_one_width():
    assert client_ids(3) == ["c00", "c01", "c02"]
    ids = client_ids(101)
    assert ids[0] == "c000" and ids[-1] == "c100"
    assert len({len(i) for i in ids}) == 1


# ----------------------------------------------------------------------------- export


def test_export_encoder_matches_torch_and_loads_with_hash(tmp_path, digits, pretrained):
    import torch

    from server_kit.nets import build_model

    exported = export_encoder(pretrained.weights, ARCH, tmp_path, metadata={"rounds": ROUNDS})
    assert exported.path == tmp_path / "fed_ae_encoder.onnx"
    assert exported.nbytes == exported.path.stat().st_size > 4 * (64 * 48 + 48 + 48 * 20 + 20)
    assert exported.sha256 == sha256_file(exported.path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entry = manifest["artifacts"]["fed_ae_encoder"]
    assert entry["sha256"] == exported.sha256
    assert entry["role"] == "encoder" and entry["latent_dim"] == 20 and entry["rounds"] == ROUNDS
    assert (tmp_path / entry["weights"]["file"]).is_file()

    enc = OnnxEncoder("fed_ae_encoder", models_dir=tmp_path)  # verify=True: hash checked
    assert enc.latent_dim == 20
    z_onnx = enc.encode(digits)  # (n, 8, 8) accepted through the manifest's image_shape
    model = build_model(ARCH)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in pretrained.weights.items()})
    model.eval()
    with torch.no_grad():
        z_torch = model.encode(torch.from_numpy(digits.reshape(len(digits), -1))).numpy()
    assert np.max(np.abs(z_onnx - z_torch)) < 1e-5
    # the result is path-like too
    assert np.array_equal(OnnxEncoder(exported).encode(digits[:5]), z_onnx[:5])

    # a tampered file is refused: the manifest hash is really checked
    data = bytearray(exported.path.read_bytes())
    data[-1] ^= 0xFF
    exported.path.write_bytes(bytes(data))
    with pytest.raises(ArtifactHashError, match="sha256"):
        OnnxEncoder("fed_ae_encoder", models_dir=tmp_path)


def test_export_encoder_keeps_other_entries_and_rejects_bad_input(tmp_path, pretrained):
    export_encoder(pretrained.weights, ARCH, tmp_path, name="first_encoder")
    export_encoder(pretrained.weights, ARCH, tmp_path, name="second_encoder")
    names = json.loads((tmp_path / "manifest.json").read_text())["artifacts"]
    assert {"first_encoder", "second_encoder"} <= set(names)
    with pytest.raises(ValueError, match="weights do not fit architecture"):
        export_encoder(initial_weights("fc_ae_64_32_16", 0), ARCH, tmp_path)
    with pytest.raises(ValueError, match="is not an autoencoder"):
        export_encoder(pretrained.weights, "digits_cnn_1x8x8_10", tmp_path)
    with pytest.raises(ValueError, match="name must be a plain file stem"):
        export_encoder(pretrained.weights, ARCH, tmp_path, name="../x")


# ----------------------------------------------------------------------------- local AE training


def test_train_autoencoder_local_learns_and_is_deterministic(digits):
    w0 = initial_weights(ARCH, 1)
    x = digits[:300]
    kw = dict(epochs=3, lr=1e-3, batch_size=32, seed=5, threads=1)  # 1 thread: fast on shared cores
    a = train_autoencoder_local(ARCH, w0, x, **kw)
    b = train_autoencoder_local(ARCH, w0, x.reshape(300, 64), **kw)
    assert a.n_samples == 300 and a.seconds > 0 and np.isfinite(a.loss)
    for k in w0:
        np.testing.assert_array_equal(a.weights[k], b.weights[k])
    assert _mse(a.weights, x) < _mse(w0, x)


def test_train_autoencoder_local_validates_inputs(digits):
    w = initial_weights(ARCH, 0)
    x = digits[:50]
    kw = dict(epochs=1, lr=1e-3, batch_size=8)
    bad_w = dict(w)
    bad_w["encoder.0.weight"] = np.zeros((3, 3), np.float32)
    nan_w = dict(w)
    nan_w["decoder.0.bias"] = np.full_like(w["decoder.0.bias"], np.nan)
    x_nan = x.copy()
    x_nan[0, 0, 0] = np.nan
    cases = [
        (("nope", w, x), {}, "unknown architecture 'nope'"),
        (("digits_cnn_1x8x8_10", w, x), {}, "is not an autoencoder"),
        ((ARCH, {k: v for k, v in w.items() if k != "decoder.2.bias"}, x), {}, "missing"),
        ((ARCH, bad_w, x), {}, r"weights\['encoder.0.weight'\] has shape \(3, 3\)"),
        ((ARCH, nan_w, x), {}, "contains NaN or Inf"),
        ((ARCH, [1, 2], x), {}, "weights must be a mapping"),
        ((ARCH, w, (x * 16).astype(np.uint8)), {}, "must be a floating-point array"),
        ((ARCH, w, x[:, :4]), {}, r"expects \(n, 64\) or \(n, 8, 8\)"),
        ((ARCH, w, x * 2), {}, r"expects \[0, 1\]"),
        ((ARCH, w, x_nan), {}, "contains NaN or Inf"),
        ((ARCH, w, x[:0]), {}, "x holds no samples"),
        ((ARCH, w, x), {"epochs": 0}, "epochs must be a positive integer, got 0"),
        ((ARCH, w, x), {"batch_size": 2.5}, "batch_size must be a positive integer"),
        ((ARCH, w, x), {"lr": float("inf")}, "lr must be a positive finite number"),
        ((ARCH, w, x), {"lr": True}, "lr must be a positive finite number"),
        ((ARCH, w, x), {"seed": 1.5}, "seed must be an integer or None"),
        ((ARCH, w, x), {"threads": 0}, "threads must be a positive integer"),
    ]
    for args, change, message in cases:
        with pytest.raises(ValueError, match=message):
            train_autoencoder_local(*args, **{**kw, **change})
