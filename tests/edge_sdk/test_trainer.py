"""Local training and evaluation: torch and ONNX Runtime paths, validation, no eager torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.models.artifacts import load_manifest, models_dir
from edge_sdk.training.trainer import (
    EvalResult,
    TrainResult,
    evaluate,
    initial_weights,
    state_spec,
    torch_available,
    train_local,
)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = "digits_cnn_1x8x8_10"
LENET = "lenet5_1x28x28_10"

needs_torch = pytest.mark.skipif(not torch_available(), reason="torch is not installed")


@pytest.fixture(scope="module")
def digits():
    """scikit-learn digits as (n, 8, 8) float32 in [0, 1]; seeded split 1400 train / 397 test."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    d = sklearn_datasets.load_digits()
    x = (d.images / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    tr, te = order[:1400], order[1400:]
    return x[tr], y[tr], x[te], y[te]


@pytest.fixture(scope="module")
def trained(digits):
    """DigitsCNN trained 5 epochs from the seeded initial weights."""
    pytest.importorskip("torch")
    x, y, _, _ = digits
    w0 = initial_weights(DIGITS, 0)
    before = {k: v.copy() for k, v in w0.items()}
    res = train_local(DIGITS, w0, x, y, epochs=5, lr=3e-3, batch_size=32, seed=0)
    for k, v in before.items():  # the received weights are not modified
        np.testing.assert_array_equal(w0[k], v)
    return w0, res


# ----------------------------------------------------------------------------- training


@needs_torch
def test_training_learns_held_out_digits(digits, trained):
    _, _, x_test, y_test = digits
    w0, res = trained
    assert isinstance(res, TrainResult)
    assert res.n_samples == 1400 and res.seconds > 0
    # measured over seeds 0-3 on this machine's floating-point path and another (ATEN_CPU_CAPABILITY=avx2, 2 BLAS threads) (seed = split and initial weights): loss 0.135-0.179,
    # held-out accuracy 0.909-0.972
    assert np.isfinite(res.loss) and res.loss < 1.0
    assert state_spec(res.weights) == state_spec(w0)
    assert all(v.dtype == np.float32 for v in res.weights.values())
    before = evaluate(DIGITS, w0, x_test, y_test)
    after = evaluate(DIGITS, res.weights, x_test, y_test)
    assert isinstance(after, EvalResult) and after.n == len(y_test)
    assert before.accuracy < 0.3  # chance is 0.1
    assert after.accuracy > 0.8, after
    assert after.loss < before.loss


@needs_torch
def test_training_is_deterministic_with_a_seed(digits):
    x, y = digits[0][:300], digits[1][:300]
    w0 = initial_weights(DIGITS, 1)
    kw = dict(epochs=2, lr=1e-3, batch_size=16)
    a = train_local(DIGITS, w0, x, y, seed=7, **kw)
    b = train_local(DIGITS, w0, x.reshape(-1, 1, 8, 8), y, seed=7, **kw)  # both layouts
    c = train_local(DIGITS, w0, x, y, seed=8, **kw)
    for k in w0:
        np.testing.assert_array_equal(a.weights[k], b.weights[k])
    assert a.loss == b.loss
    assert any(not np.array_equal(a.weights[k], c.weights[k]) for k in w0)


@needs_torch
def test_read_only_inputs_from_the_wire_are_accepted_quietly(digits):
    import warnings

    def frozen(a):
        b = np.array(a)
        b.flags.writeable = False
        return b

    w = {k: frozen(v) for k, v in initial_weights(DIGITS, 0).items()}
    x, y = frozen(digits[0][:32]), frozen(digits[1][:32])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = train_local(DIGITS, w, x, y, epochs=1, lr=np.float32(1e-3), batch_size=8, seed=0)
        evaluate(DIGITS, res.weights, x, y)
        evaluate(DIGITS, w, x, y, force_onnx=True)


@needs_torch
def test_training_leaves_the_callers_torch_rng_alone(digits):
    import torch

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    train_local(
        DIGITS,
        initial_weights(DIGITS, 0),
        digits[0][:64],
        digits[1][:64],
        epochs=1,
        lr=1e-3,
        batch_size=32,
        seed=3,
        optimizer="sgd",
    )
    assert torch.equal(torch.random.get_rng_state(), state)


@needs_torch
def test_initial_weights_have_the_shipped_templates_layout_and_depend_on_the_seed():
    """The portable initial weights (edge_sdk.models.portable_init) have the shipped files' tensors, not their values."""
    from safetensors.numpy import load_file

    manifest = load_manifest()
    for name, arch in (("digits_cnn", DIGITS), ("lenet5", LENET)):
        shipped = load_file(str(models_dir() / manifest[name].extra["weights"]["file"]))
        ours = initial_weights(arch, 0)
        assert state_spec(ours) == state_spec(shipped), name
    a, b = initial_weights(DIGITS, 1), initial_weights(DIGITS, 2)
    assert not np.array_equal(a["conv1.weight"], b["conv1.weight"])


def test_state_spec_names_shapes_and_dtypes():
    w = {"a.weight": np.zeros((2, 3), np.float32), "n": np.array(4, dtype=np.int64)}
    assert state_spec(w) == {"a.weight": ((2, 3), "float32"), "n": ((), "int64")}


@needs_torch
def test_base_layer_prefixes_select_exactly_the_conv_layers():
    from edge_sdk.training.nets import BASE_LAYERS, DigitsCNN, build_model, count_params

    assert count_params(DigitsCNN()) == 13_706
    for arch, prefixes in BASE_LAYERS.items():
        names = list(build_model(arch).state_dict())
        for p in prefixes:
            assert p.endswith(".")
            assert [n for n in names if n.startswith(p)] == [p + "weight", p + "bias"], (arch, p)
        convs = [m for m in build_model(arch).modules() if type(m).__name__ == "Conv2d"]
        assert len(convs) == len(prefixes) == 2


# ----------------------------------------------------------------------------- validation


def _bad_cases(x, y, w):
    nan_w = dict(w)
    nan_w["fc1.bias"] = np.full_like(w["fc1.bias"], np.nan)
    short_w = {k: v for k, v in w.items() if k != "fc2.weight"}
    extra_w = dict(w, **{"fc3.weight": np.zeros(3, np.float32)})
    shape_w = dict(w, **{"conv1.weight": np.zeros((16, 1, 5, 5), np.float32)})
    x_nan = x.copy()
    x_nan[0, 0, 0] = np.nan
    return [
        (dict(architecture="resnet1000"), "unknown architecture 'resnet1000'"),
        (dict(architecture="fc_ae_64_32_16"), "is not a classifier"),
        (dict(weights=short_w), r"do not match architecture .*missing \['fc2.weight'\]"),
        (dict(weights=extra_w), r"unexpected \['fc3.weight'\]"),
        (dict(weights=shape_w), r"weights\['conv1.weight'\] has shape \(16, 1, 5, 5\)"),
        (dict(weights=nan_w), r"weights\['fc1.bias'\] contains NaN or Inf"),
        (
            dict(x=x.reshape(-1, 64)),
            r"x has shape \(\d+, 64\); model .* expects \(n, 1, 8, 8\) or \(n, 8, 8\)",
        ),
        (dict(x=(x * 16).astype(np.uint8)), "floating-point array"),
        (dict(x=x * 16), r"values span \[0, 16\]; model .* expects \[0, 1\]"),
        (dict(x=x_nan), "x contains NaN or Inf"),
        (
            dict(y=np.where(y == 9, 10, y)),
            r"labels must lie in \[0, 9\] .* got values in \[0, 10\]",
        ),
        (dict(y=y.astype(np.float32)), "y must hold integer class labels"),
        (dict(y=y[:-1]), r"expected \(\d+,\), one label per sample"),
        (dict(x=x[:0], y=y[:0]), "x holds no samples"),
    ]


@needs_torch
def test_train_local_rejects_bad_input(digits):
    x, y = digits[0][:40], digits[1][:40]
    w = initial_weights(DIGITS, 0)
    base = dict(architecture=DIGITS, weights=w, x=x, y=y)
    for change, message in _bad_cases(x, y, w):
        args = {**base, **change}
        with pytest.raises(ValueError, match=message):
            train_local(
                args["architecture"],
                args["weights"],
                args["x"],
                args["y"],
                epochs=1,
                lr=1e-3,
                batch_size=8,
            )
    hyper = [
        (dict(epochs=0), "epochs must be a positive integer, got 0"),
        (dict(batch_size=2.5), "batch_size must be a positive integer"),
        (dict(lr=-1.0), "lr must be a positive finite number"),
        (dict(lr=float("nan")), "lr must be a positive finite number"),
        (dict(optimizer="rmsprop"), r"optimizer must be one of \['adam', 'sgd'\], got 'rmsprop'"),
        (dict(threads=0), "threads must be a positive integer"),
    ]
    for change, message in hyper:
        kw = {"epochs": 1, "lr": 1e-3, "batch_size": 8, **change}
        with pytest.raises(ValueError, match=message):
            train_local(DIGITS, w, x, y, **kw)


def test_onnx_evaluate_rejects_bad_input(digits):
    x, y = digits[2][:40], digits[3][:40]
    from safetensors.numpy import load_file

    spec = load_manifest()["digits_cnn"]
    w = load_file(str(models_dir() / spec.extra["weights"]["file"]))
    base = dict(architecture=DIGITS, weights=w, x=x, y=y)
    for change, message in _bad_cases(x, y, w):
        args = {**base, **change}
        if args["architecture"] != DIGITS:
            message = "no classifier template"
        with pytest.raises(ValueError, match=message):
            evaluate(args["architecture"], args["weights"], args["x"], args["y"], force_onnx=True)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        evaluate(DIGITS, w, x, y, batch_size=0, force_onnx=True)


# ----------------------------------------------------------------------------- ONNX == torch


@needs_torch
def test_onnx_evaluation_equals_torch_on_trained_digits(digits, trained):
    _, _, x_test, y_test = digits
    w = trained[1].weights  # not the template's weights: every initializer is replaced
    t = evaluate(DIGITS, w, x_test, y_test)
    o = evaluate(DIGITS, w, x_test, y_test, force_onnx=True, batch_size=50)
    assert o.n == t.n == len(y_test)
    assert o.accuracy == t.accuracy
    assert abs(o.loss - t.loss) < 1e-5
    # the template's own weights give another answer: the override took effect
    tpl = evaluate(DIGITS, initial_weights(DIGITS, 0), x_test, y_test, force_onnx=True)
    assert tpl.accuracy != o.accuracy


@needs_torch
def test_onnx_evaluation_equals_torch_on_lenet5():
    rng = np.random.default_rng(5)
    w = initial_weights(LENET, 11)
    w = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in w.items()}
    x = rng.random((300, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, 300)
    t = evaluate(LENET, w, x, y)
    o = evaluate(LENET, w, x, y, force_onnx=True)
    assert o.accuracy == t.accuracy
    assert abs(o.loss - t.loss) < 1e-5


# ----------------------------------------------------------------------------- without torch


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_importing_the_trainer_does_not_import_torch():
    proc = _run(
        """
        import sys
        import edge_sdk, edge_sdk.training.trainer
        assert "torch" not in sys.modules, "torch imported"
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_a_device_without_torch_evaluates_with_onnx_runtime():
    proc = _run(
        """
        import sys
        sys.modules["torch"] = None  # torch cannot be imported in this process
        import numpy as np
        from safetensors.numpy import load_file
        from edge_sdk.models.artifacts import load_manifest, models_dir
        from edge_sdk.training.trainer import evaluate, torch_available, train_local

        assert not torch_available()
        w = load_file(str(models_dir() / load_manifest()["digits_cnn"].extra["weights"]["file"]))
        rng = np.random.default_rng(0)
        x, y = rng.random((20, 8, 8), dtype=np.float32), rng.integers(0, 10, 20)
        r = evaluate("digits_cnn_1x8x8_10", w, x, y)
        assert r.n == 20 and 0.0 <= r.accuracy <= 1.0 and r.loss > 0
        try:
            train_local("digits_cnn_1x8x8_10", w, x, y, epochs=1, lr=1e-3, batch_size=4)
        except ImportError as e:
            assert "needs torch" in str(e)
        else:
            raise AssertionError("train_local ran without torch")
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
