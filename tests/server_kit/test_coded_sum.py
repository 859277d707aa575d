"""Compressed updates decoded where the sums live (server_kit.coded_sum): the host path's bits, bad codes refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edge_sdk.compress import Compression, Method, decode_delta, encode_delta  # noqa: E402
from edge_sdk.compress.frames import frame_delta, frame_values  # noqa: E402
from edge_sdk.compress.update_codec import with_delta  # noqa: E402
from edge_sdk.protocol import ProtocolError  # noqa: E402
from server_kit.aggregate import Refused, StreamingFedAvg  # noqa: E402

# odd sizes (a padding nibble), a 0-d tensor, a tensor over one block of 256, an integer counter
SHAPES = {"a.weight": (33, 7), "b.bias": (257,), "c": (), "d": (3, 3, 5), "e": (4, 256)}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(seed=0):
    rng = np.random.default_rng(seed)
    out = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    out["bn.num_batches_tracked"] = np.array(40, dtype=np.int64)
    return out


def _spec(model):
    return {k: (np.shape(v), "float32") for k, v in model.items()}


def _bodies(method, k, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        delta = {n: (rng.normal(size=np.shape(v)) * 0.05).astype(np.float32) for n, v in _model().items()}
        delta["bn.num_batches_tracked"] = np.array(8.0, dtype=np.float32)
        out.append((encode_delta(delta, Compression.parse(method))[0], int(rng.integers(1, 500))))
    return out


def _both(method, device, dtype, bodies):
    base, m = _model(), Method(method)
    host = StreamingFedAvg(base, kernels="staged", device=device, dtype=dtype)
    card = StreamingFedAvg(base, kernels="staged", device=device, dtype=dtype)
    for body, n in bodies:
        host.add(with_delta(base, decode_delta(body, _spec(base), m)), n, tag=n)
        card.add_coded(frame_delta(body, _spec(base), m), m, base, n, tag=n)
    return host, card


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_decoding_on_the_device_sums_the_host_paths_bits(method, dtype):
    host, card = _both(method, "cpu", dtype, _bodies(method, 5))
    a, b = host.result(), card.result()
    assert card.count == host.count == 5 and card.total_samples == host.total_samples
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    assert b["bn.num_batches_tracked"] == 48  # the counter decoded on the host, rounded, kept integer


@CUDA
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_decoding_on_cuda_sums_the_host_paths_bits(method):
    host, card = _both(method, "cuda", torch.float32, _bodies(method, 5))
    a, b = host.result(), card.result()
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)


def _corrupt(body, method, name, how):
    """``body`` with one code of tensor ``name`` out of range (``how``: "code" or "pad")."""
    base = _model()
    frames = {f.name: f for f in frame_delta(body, _spec(base), Method(method))}
    f = frames[name]
    at = f.codes.ctypes.data - np.frombuffer(body, np.uint8).ctypes.data
    raw = bytearray(body)
    if method == "int8":
        raw[at + 3] = 0x80  # -128
    elif how == "code":
        raw[at + 2] &= 0xF0  # a low nibble 0
    else:
        raw[at + f.codes.size - 1] |= 0x30  # the padding nibble of an odd-sized tensor
    return bytes(raw)


@pytest.mark.parametrize("method, name, how", [("int8", "d", "code"), ("int4", "e", "code"),
                                               ("int4", "a.weight", "pad")])
def test_a_code_out_of_range_is_refused_at_settle_and_adds_nothing(method, name, how):
    bodies = _bodies(method, 3)
    bad = _corrupt(bodies[1][0], method, name, how)
    with pytest.raises(ProtocolError) as e:  # what the host path says of it
        decode_delta(bad, _spec(_model()), Method(method))
    assert e.value.reason == "compressed-value" and f"tensor {name!r}" in str(e.value)
    honest = [bodies[0], bodies[2]]
    _, clean = _both(method, "cpu", torch.float64, honest)
    base, m = _model(), Method(method)
    card = StreamingFedAvg(base, kernels="staged", device="cpu")
    for body, n in [bodies[0], (bad, bodies[1][1]), bodies[2]]:
        card.add_coded(frame_delta(body, _spec(base), m), m, base, n, tag=n)
    refused = card.settle()
    assert refused == [Refused(bodies[1][1], name, f"update: tensor {name!r} holds a code out of range "
                                                   "(compressed-value)")]
    assert card.count == 2
    a, b = clean.result(), card.result()
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)


def test_a_huge_scale_that_makes_inf_is_refused_as_a_nan_is():
    base, m = _model(), Method.INT8
    body, n = _bodies("int8", 1)[0]
    f = {x.name: x for x in frame_delta(body, _spec(base), m)}["e"]
    at = f.codes.ctypes.data - np.frombuffer(body, np.uint8).ctypes.data - 4  # the tensor's scale
    raw = bytearray(body)
    raw[at:at + 4] = np.float32(3e38).tobytes()
    card = StreamingFedAvg(base, kernels="staged", device="cpu")
    card.add_coded(frame_delta(bytes(raw), _spec(base), m), m, base, n, tag="x")
    assert card.settle() == [Refused("x", "e", "update: tensor 'e' contains NaN or Inf")]


def test_the_numpy_path_decodes_on_the_host_and_raises_as_decode_delta_does():
    base, m = _model(), Method.INT4
    bodies = _bodies("int4", 2)
    flat = StreamingFedAvg(base, kernels="numpy")
    staged = StreamingFedAvg(base, kernels="staged", device="cpu")
    for body, n in bodies:
        flat.add_coded(frame_delta(body, _spec(base), m), m, base, n)
        staged.add_coded(frame_delta(body, _spec(base), m), m, base, n)
    a, b = flat.result(), staged.result()
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)  # both accumulate in float64 in the same order
    bad = _corrupt(bodies[0][0], "int4", "e", "code")
    with pytest.raises(ProtocolError, match="nibble 0"):
        flat.add_coded(frame_delta(bad, _spec(base), m), m, base, 1)


def test_frames_are_checked_as_decode_delta_checks_all_but_the_codes():
    base, m = _model(), Method.INT4
    body, _ = _bodies("int4", 1)[0]
    frames = frame_delta(body, _spec(base), m)
    assert [f.name for f in frames] == sorted(base)
    for f in frames:  # the host decoding of a frame is decode_delta's, bit for bit
        assert frame_values(f, m).tobytes() == decode_delta(body, _spec(base), m)[f.name].tobytes()
    for bad, method, reason in [(body + b"\0", m, "compressed-length"), (body[:-1], m, "compressed-length"),
                                (body, Method.INT8, "compressed-method")]:
        with pytest.raises(ProtocolError) as e:
            frame_delta(bad, _spec(base), method)
        assert e.value.reason == reason
    with pytest.raises(ValueError, match="int8 and int4 bodies, not sign"):
        frame_delta(body, _spec(base), Method.SIGN)
    card = StreamingFedAvg({k: v for k, v in base.items() if k != "c"}, kernels="staged", device="cpu")
    with pytest.raises(ValueError, match="tensor 'a.weight' is of shape"):
        card.add_coded([f if f.name != "a.weight" else type(f)(f.name, (7, 33), f.scales, f.codes)
                        for f in frames], m, base, 1)
