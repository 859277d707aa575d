"""Seeded partitioners (ground-truth groups, shards, transforms) and IDX checksums."""

from __future__ import annotations

import gzip
import hashlib
import logging
import struct
from pathlib import Path

import numpy as np
import pytest

from server_kit.data import idx
from server_kit.data.idx import KNOWN_SHA256, load_fashion_mnist, load_idx_dataset, load_mnist
from server_kit.data.partition import (
    OCFL_CLASS_SETS,
    OCFL_IMBALANCED_SHARES,
    OCFL_OVERLAPPING_CLASS_SETS,
    OCFL_SPLITS,
    ClientData,
    class_set_groups,
    dirichlet_indices,
    group_assignment,
    group_sizes_from_shares,
    label_flip_groups,
    load_client,
    pathological_partition,
    rotation_groups,
    rotation_partition,
    save_client,
    summarize,
)

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def _data(per_class: int = 100, num_classes: int = 10, side: int = 5, seed: int = 0):
    """Balanced labels and random (hence unique, asymmetric) square images."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(num_classes, dtype=np.int64), per_class)
    images = rng.random((len(labels), side, side)).astype(np.float32)
    return images, labels


def _source_indices(images: np.ndarray, x: np.ndarray, k: int = 0) -> np.ndarray:
    """Index in ``images`` of each sample of ``x``, after undoing a rotation by ``k``."""
    lookup = {img.tobytes(): i for i, img in enumerate(images)}
    back = np.rot90(x, k=-k, axes=(1, 2))
    return np.array([lookup[np.ascontiguousarray(img).tobytes()] for img in back], dtype=np.int64)


def _all_samples(client: ClientData):
    return (np.concatenate([client.x_train, client.x_test]),
            np.concatenate([client.y_train, client.y_test]))


def _max_share(clients: list[ClientData]) -> float:
    """Mean over clients of the largest class share of their label histogram."""
    hists = np.array([r["label_hist"] for r in summarize(clients)["clients"]], dtype=float)
    return float((hists.max(axis=1) / hists.sum(axis=1)).mean())


def _same(a: list[ClientData], b: list[ClientData]) -> bool:
    return len(a) == len(b) and all(
        p.cid == q.cid and p.group == q.group
        and np.array_equal(p.x_train, q.x_train) and np.array_equal(p.y_train, q.y_train)
        and np.array_equal(p.x_test, q.x_test) and np.array_equal(p.y_test, q.y_test)
        for p, q in zip(a, b)
    )


# ----------------------------------------------------------------------------- groups and ids


def test_groups_are_i_mod_g_and_ids_padded():
    images, labels = _data(per_class=30)
    clients = rotation_groups(images, labels, 10, groups=4, min_size=5)
    assert [c.group for c in clients] == [i % 4 for i in range(10)]
    assert [c.cid for c in clients] == [f"c{i:02d}" for i in range(10)]
    s = summarize(clients)
    assert s["group_counts"] == {0: 3, 1: 3, 2: 2, 3: 2}
    assert s["n_clients"] == 10 and s["n_groups"] == 4 and s["n_samples"] == len(labels)

    clients = label_flip_groups(images, labels, 120, groups=3, min_size=2, prefix="dev")
    assert [c.cid for c in clients[:2]] == ["dev000", "dev001"] and clients[-1].cid == "dev119"
    assert summarize(clients)["group_counts"] == {0: 40, 1: 40, 2: 40}


def test_uneven_group_sizes():
    images, labels = _data(per_class=30)
    for make in (rotation_groups, label_flip_groups):
        clients = make(images, labels, 10, group_sizes=[5, 2, 3], min_size=5)
        assert [c.group for c in clients] == [0] * 5 + [1] * 2 + [2] * 3
        assert summarize(clients)["group_counts"] == {0: 5, 1: 2, 2: 3}
    np.testing.assert_array_equal(group_assignment(7, group_sizes=[1, 6]), [0, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(group_assignment(5, 2), [0, 1, 0, 1, 0])
    np.testing.assert_array_equal(group_assignment(3), [0, 1, 2])


# ----------------------------------------------------------------------------- rotation and flips


@pytest.mark.parametrize("alpha", [None, 1.0])
def test_rotation_applied_and_shards_disjoint_covering(alpha):
    images, labels = _data(per_class=40)
    clients = rotation_groups(images, labels, 12, alpha=alpha, min_size=10, test_fraction=0.25, seed=3)
    seen = []
    for c in clients:
        for x, y in ((c.x_train, c.y_train), (c.x_test, c.y_test)):
            src = _source_indices(images, x, k=c.group)
            np.testing.assert_array_equal(x, np.rot90(images[src], k=c.group, axes=(1, 2)))
            np.testing.assert_array_equal(y, labels[src])
            seen.append(src)
        n = len(c.y_train) + len(c.y_test)
        assert len(c.y_test) == round(0.25 * n) and n >= 10
        assert c.x_train.dtype == images.dtype and c.x_train.flags.c_contiguous
    seen = np.concatenate(seen)
    assert len(seen) == len(labels) and len(np.unique(seen)) == len(labels)  # disjoint, covering


def test_rotation_paper_mnist_scenario_shape():
    images, labels = _data(per_class=300, side=4)
    clients = rotation_groups(images, labels, 100, alpha=10)
    s = summarize(clients)
    assert s["group_counts"] == {0: 25, 1: 25, 2: 25, 3: 25}
    assert min(r["n_train"] + r["n_test"] for r in s["clients"]) >= 10
    assert clients[0].cid == "c000" and clients[99].cid == "c099"
    assert [c.group for c in clients[:5]] == [0, 1, 2, 3, 0]


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_label_flip_mapping_exact(alpha):
    images, labels = _data(per_class=40)
    clients = label_flip_groups(images, labels.astype(np.uint8), 8, groups=4, alpha=alpha,
                                min_size=10, seed=1)
    seen = []
    for c in clients:
        for x, y in ((c.x_train, c.y_train), (c.x_test, c.y_test)):
            src = _source_indices(images, x)
            np.testing.assert_array_equal(x, images[src])  # images untouched
            assert y.dtype == np.uint8
            np.testing.assert_array_equal(y, (labels[src] - c.group) % 10)
            seen.append(src)
    seen = np.concatenate(seen)
    assert np.array_equal(np.sort(seen), np.arange(len(labels)))
    assert {c.group for c in clients} == {0, 1, 2, 3}
    # group 0 keeps the labels; group 1 maps 0 -> 9
    g1 = next(c for c in clients if c.group == 1)
    x, y = _all_samples(g1)
    src = _source_indices(images, x)
    assert np.all(y[labels[src] == 0] == 9)


# ----------------------------------------------------------------------------- Dirichlet skew


def test_dirichlet_indices_skew_and_min_size():
    _, labels = _data(per_class=500)
    skewed = dirichlet_indices(labels, 10, 0.1, min_size=10, seed=0)
    uniform = dirichlet_indices(labels, 10, 1000.0, min_size=10, seed=0)
    for shards in (skewed, uniform):
        assert all(s.dtype == np.int64 and len(s) >= 10 for s in shards)
        allidx = np.concatenate(shards)
        assert np.array_equal(np.sort(allidx), np.arange(len(labels)))

    def share(shards):
        hists = np.array([np.bincount(labels[s], minlength=10) for s in shards], dtype=float)
        return (hists.max(axis=1) / hists.sum(axis=1)).mean()

    assert share(skewed) > 0.4
    assert share(uniform) < 0.15
    # shards come shuffled, not sorted by class (the test split is the first part)
    assert any(np.any(np.diff(labels[s]) < 0) for s in uniform)


def test_dirichlet_partition_skew_via_partitioners():
    images, labels = _data(per_class=200)
    lo = rotation_groups(images, labels, 10, alpha=0.1, seed=2)
    hi = label_flip_groups(images, labels, 10, alpha=1000.0, seed=2)
    assert _max_share(lo) > 0.4 > 0.15 > _max_share(hi)
    assert all(len(c.y_train) + len(c.y_test) >= 10 for c in lo + hi)


def test_dirichlet_bounded_retries_raise():
    _, labels = _data(per_class=50)
    with pytest.raises(ValueError, match=r"max_tries=3 .* min_size=40"):
        dirichlet_indices(labels, 10, 0.01, min_size=40, max_tries=3)
    with pytest.raises(ValueError, match="min_size=60 is infeasible"):
        dirichlet_indices(labels, 10, 1.0, min_size=60)


# ----------------------------------------------------------------------------- pathological


def test_pathological_classes_per_client():
    images, labels = _data(per_class=60)
    clients = pathological_partition(images, labels, 20, classes_per_client=2, seed=4)
    rows = summarize(clients)["clients"]
    assert all(len(r["classes"]) == 2 for r in rows)
    by_group: dict[int, set] = {}
    for c, r in zip(clients, rows):
        by_group.setdefault(c.group, set()).add(tuple(r["classes"]))
    assert all(len(sets) == 1 for sets in by_group.values())  # one class set per group
    assert len({next(iter(s)) for s in by_group.values()}) == len(by_group)  # and vice versa
    assert sorted(by_group) == list(range(len(by_group)))
    seen = np.concatenate([_source_indices(images, _all_samples(c)[0]) for c in clients])
    assert len(np.unique(seen)) == len(seen)

    clients = pathological_partition(images, labels, 3, classes_per_client=1, min_size=5)
    assert all(len(r["classes"]) == 1 for r in summarize(clients)["clients"])


def test_pathological_explicit_class_sets():
    images, labels = _data(per_class=30)
    sets = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    clients = pathological_partition(images, labels, 6, class_sets=sets, group_sizes=[2, 1, 3])
    assert [c.group for c in clients] == [0, 0, 1, 2, 2, 2]
    for c, r in zip(clients, summarize(clients)["clients"]):
        assert r["classes"] == sets[c.group]
    # every class is held, so the shards cover all the data
    seen = np.concatenate([_source_indices(images, _all_samples(c)[0]) for c in clients])
    assert np.array_equal(np.sort(seen), np.arange(len(labels)))


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y, s: rotation_groups(x, y, 8, seed=s),
        lambda x, y, s: rotation_groups(x, y, 8, alpha=0.5, seed=s),
        lambda x, y, s: label_flip_groups(x, y, 8, alpha=2.0, seed=s),
        lambda x, y, s: pathological_partition(x, y, 8, seed=s),
    ],
)
def test_seeded_determinism(make):
    images, labels = _data(per_class=40)
    assert _same(make(images, labels, 7), make(images, labels, 7))
    assert not _same(make(images, labels, 7), make(images, labels, 8))


def test_dirichlet_indices_deterministic():
    _, labels = _data(per_class=50)
    a = dirichlet_indices(labels, 5, 0.5, seed=11)
    b = dirichlet_indices(labels, 5, 0.5, seed=11)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    # a partition of every sample (each once, at least min_size=10 per client), of the very sizes seed 11 draws;
    # another seed draws other shards
    assert np.array_equal(np.sort(np.concatenate(a)), np.arange(len(labels)))
    assert [len(p) for p in a] == [113, 66, 159, 134, 28]
    assert [len(p) for p in dirichlet_indices(labels, 5, 0.5, seed=12)] == [102, 90, 75, 89, 144]


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x, y: rotation_groups(x, y, 0), "n_clients must be >= 1"),
        (lambda x, y: rotation_groups(x, y, 4, groups=5), "groups must be between 1 and 4"),
        (lambda x, y: rotation_groups(x, y, 4, groups=0), "groups must be >= 1"),
        (lambda x, y: rotation_groups(x, y, 4, alpha=0.0), "alpha must be a positive"),
        (lambda x, y: rotation_groups(x, y, 4, test_fraction=1.0), "test_fraction must be in"),
        (lambda x, y: rotation_groups(x[:, :, :4], y, 4), "images must be square"),
        (lambda x, y: rotation_groups(x, y[:-1], 4), "same length"),
        (lambda x, y: rotation_groups(x, y, 4, min_size=1000), "min_size=1000"),
        (lambda x, y: rotation_groups(x, y, 4, group_sizes=[2, 1]), "group_sizes must sum to"),
        (lambda x, y: rotation_groups(x, y, 3, groups=3, group_sizes=[2, 1]), "groups=3 disagrees"),
        (lambda x, y: label_flip_groups(x, y, 4, group_sizes=[0, 4]), "group_sizes entries"),
        (lambda x, y: label_flip_groups(x, y, 4, num_classes=5), "num_classes=5"),
        (lambda x, y: label_flip_groups(x, y, 12, groups=11), "at most num_classes=10"),
        (lambda x, y: label_flip_groups(x, y.astype(float), 4), "labels must be integers"),
        (lambda x, y: pathological_partition(x, y, 4, classes_per_client=11),
         "classes_per_client=11 exceeds"),
        (lambda x, y: pathological_partition(x, y, 4, classes_per_client=0),
         "classes_per_client must be >= 1"),
        (lambda x, y: pathological_partition(x, y, 4, class_sets=[[0], [0]]), "distinct sets"),
        (lambda x, y: pathological_partition(x, y, 4, class_sets=[[0], []]), "empty set"),
        (lambda x, y: pathological_partition(x, y, 4, group_sizes=[2, 2]), "group_sizes needs"),
        (lambda x, y: pathological_partition(x, y, 40, classes_per_client=1), "min_size=10"),
        (lambda x, y: dirichlet_indices(y, 4, -1.0), "alpha must be a positive"),
        (lambda x, y: dirichlet_indices(y, 4, 1.0, max_tries=0), "max_tries must be >= 1"),
        (lambda x, y: dirichlet_indices(y.reshape(10, -1), 4, 1.0), "labels must be a non-empty 1-D"),
        (lambda x, y: summarize([]), "clients must not be empty"),
    ],
)
def test_bad_arguments_raise(call, match):
    images, labels = _data(per_class=20)
    with pytest.raises(ValueError, match=match):
        call(images, labels)


def test_legacy_rotation_partition_and_npz_roundtrip(tmp_path):
    images, labels = _data(per_class=10)
    clients = rotation_partition(images, labels, 5, groups=4, seed=0)
    assert [c.group for c in clients] == [0, 1, 2, 3, 0]
    save_client(tmp_path / "c.npz", clients[1])
    back = load_client(tmp_path / "c.npz")
    assert _same([back], [clients[1]])


# ----------------------------------------------------------------------------- IDX checksums


def _idx_bytes(arr: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def _write_split(folder: Path, n: int = 3, gz: bool = True, split: str = "train") -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    img_stem, lbl_stem = idx.IDX_FILES[split]
    ext = ".gz" if gz else ""
    images = np.arange(n * 28 * 28, dtype=np.int64).reshape(n, 28, 28) % 256
    labels = np.arange(n) % 10
    ip, lp = folder / (img_stem + ext), folder / (lbl_stem + ext)
    pack = gzip.compress if gz else (lambda b: b)
    ip.write_bytes(pack(_idx_bytes(images)))
    lp.write_bytes(pack(_idx_bytes(labels)))
    return ip, lp


def test_checksum_mismatch_names_file_and_hashes(tmp_path):
    ip, _ = _write_split(tmp_path)
    actual = hashlib.sha256(ip.read_bytes()).hexdigest()
    expected = KNOWN_SHA256[("mnist", "train-images-idx3-ubyte.gz")]
    with pytest.raises(ValueError, match="sha256 mismatch") as err:
        load_idx_dataset(tmp_path, "train", dataset="mnist")
    msg = str(err.value)
    assert str(ip) in msg and expected in msg and actual in msg
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz"):
        load_fashion_mnist(tmp_path)
    x, _ = load_idx_dataset(tmp_path, "train", dataset="mnist", verify=False)
    assert x.shape == (3, 28, 28)


def test_checksum_detects_dataset_from_one_file(tmp_path, monkeypatch):
    ip, lp = _write_split(tmp_path)
    digest = hashlib.sha256(ip.read_bytes()).hexdigest()
    # pretend the fake images are the published MNIST train images
    monkeypatch.setitem(idx.KNOWN_SHA256, ("mnist", ip.name), digest)
    monkeypatch.setitem(idx._BY_SHA256, digest, ("mnist", ip.name))
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz: sha256 mismatch for MNIST"):
        load_idx_dataset(tmp_path, "train")  # labels now must match MNIST's too
    lbl_digest = hashlib.sha256(lp.read_bytes()).hexdigest()
    monkeypatch.setitem(idx.KNOWN_SHA256, ("mnist", lp.name), lbl_digest)
    x, y = load_idx_dataset(tmp_path, "train", verify="strict")
    assert x.shape == (3, 28, 28) and y.tolist() == [0, 1, 2]


def test_unknown_files_warn_or_fail_strict(tmp_path, caplog):
    ip, _ = _write_split(tmp_path, gz=False)
    with caplog.at_level(logging.WARNING, logger="server_kit.data.idx"):
        x, y = load_mnist(tmp_path)
    assert "checksum not verified" in caplog.text and ip.name in caplog.text
    assert x.dtype == np.float32 and x.shape == (3, 28, 28) and 0.0 <= x.min() <= x.max() <= 1.0
    assert y.dtype == np.int64 and y.tolist() == [0, 1, 2]
    np.testing.assert_allclose(x[0, 0, :3] * 255, [0, 1, 2], atol=1e-4)
    with pytest.raises(ValueError, match="cannot verify"):
        load_mnist(tmp_path, verify="strict")
    # unrecognised .gz files and no dataset named: accepted with a warning, refused when strict
    _write_split(tmp_path / "gz")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="server_kit.data.idx"):
        load_idx_dataset(tmp_path / "gz", "train")
    assert "matches no published" in caplog.text
    with pytest.raises(ValueError, match="verify='strict'"):
        load_idx_dataset(tmp_path / "gz", "train", verify="strict")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="server_kit.data.idx"):
        load_idx_dataset(tmp_path / "gz", "train", verify=False)
    assert caplog.text == ""


def test_load_named_finds_subfolder_and_rejects_bad_options(tmp_path):
    _write_split(tmp_path / "fashion-mnist", gz=False, split="test")
    x, y = load_fashion_mnist(tmp_path, "test")
    assert x.shape == (3, 28, 28) and y.dtype == np.int64
    with pytest.raises(ValueError, match="verify must be"):
        load_idx_dataset(tmp_path / "fashion-mnist", "test", verify="yes")
    with pytest.raises(ValueError, match="dataset must be one of"):
        load_idx_dataset(tmp_path / "fashion-mnist", "test", dataset="cifar10")


@pytest.mark.skipif(not (SHARED_DATA / "mnist").is_dir(), reason="shared/data not present")
def test_real_mnist_verified_counts_and_paper_partition():
    sums = dict(reversed(line.split()) for line in (SHARED_DATA / "SHA256SUMS").read_text().splitlines())
    for (dataset, name), digest in KNOWN_SHA256.items():
        assert sums[f"{dataset}/{name}"] == digest
    x, y = load_mnist(SHARED_DATA, "train")
    assert x.shape == (60000, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.bincount(y).tolist() == MNIST_TRAIN_COUNTS
    assert 0.0 == x.min() and x.max() == 1.0
    clients = rotation_groups(x, y, 100, alpha=10)
    s = summarize(clients)
    assert s["group_counts"] == {0: 25, 1: 25, 2: 25, 3: 25} and s["n_samples"] == 60000
    assert min(r["n_train"] + r["n_test"] for r in s["clients"]) >= 10
    c = clients[1]
    assert c.x_train.shape[1:] == (28, 28) and c.group == 1


# ----------------------------------------------------------------------------- the OCFL splits (class sets)


def _held(clients: list[ClientData]) -> list[set[int]]:
    return [set(np.concatenate([c.y_train, c.y_test]).tolist()) for c in clients]


def _source_rows(images: np.ndarray, clients: list[ClientData]) -> list[np.ndarray]:
    return [_source_indices(images, _all_samples(c)[0]) for c in clients]


def test_group_sizes_from_shares_largest_remainder():
    assert group_sizes_from_shares(15, OCFL_IMBALANCED_SHARES) == [3, 7, 5]  # the paper's 15-client split
    assert group_sizes_from_shares(30, OCFL_IMBALANCED_SHARES) == [6, 14, 10]
    assert group_sizes_from_shares(10, [0.25, 0.25, 0.5]) == [3, 2, 5]  # tie of .5 and .5: the first group
    assert group_sizes_from_shares(3, [0.2, 0.47, 0.33]) == [1, 1, 1]
    with pytest.raises(ValueError, match="n_clients=2 is too few"):
        group_sizes_from_shares(2, OCFL_IMBALANCED_SHARES)


def test_class_sets_balanced_nonoverlapping_exact_counts():
    images, labels = _data(per_class=100)
    clients = class_set_groups(images, labels, 15, seed=0)
    assert [c.group for c in clients] == [0, 1, 2] * 5 and clients[0].cid == "c00"
    for c, held in zip(clients, _held(clients)):
        assert held == set(OCFL_CLASS_SETS[c.group])
        hist = np.bincount(_all_samples(c)[1], minlength=10)
        assert hist[list(OCFL_CLASS_SETS[c.group])].tolist() == [20] * len(OCFL_CLASS_SETS[c.group])  # 100 / 5
        assert len(c.y_test) == round(0.2 * hist.sum())
    rows = np.concatenate(_source_rows(images, clients))
    assert len(rows) == len(set(rows.tolist())) == 1000  # disjoint, and every sample is used


def test_class_sets_overlapping_follow_the_authors_sets():
    images, labels = _data(per_class=120)
    clients = class_set_groups(images, labels, 6, overlapping=True, seed=1)
    assert OCFL_OVERLAPPING_CLASS_SETS == ((0, 1, 2, 3, 8, 9), (4, 5, 6, 7, 8, 9), (0, 1, 2, 3, 4, 5))
    held = _held(clients)
    assert all(h == set(OCFL_OVERLAPPING_CLASS_SETS[c.group]) for c, h in zip(clients, held))
    by_group = [set().union(*(h for c, h in zip(clients, held) if c.group == g)) for g in range(3)]
    assert by_group[0] & by_group[1] == {8, 9} and by_group[0] & by_group[2] == {0, 1, 2, 3}
    assert by_group[1] & by_group[2] == {4, 5}
    # class 8 is held by the 4 clients of groups 0 and 1: 30 samples each, none shared
    assert [int((_all_samples(c)[1] == 8).sum()) for c in clients] == [30, 30, 0, 30, 30, 0]
    rows = np.concatenate(_source_rows(images, clients))
    assert len(rows) == len(set(rows.tolist()))


def test_class_sets_imbalanced_groups_and_label_skew():
    images, labels = _data(per_class=300)
    bal = class_set_groups(images, labels, 15, **OCFL_SPLITS["nonoverlap_balanced"])
    imb = class_set_groups(images, labels, 15, **OCFL_SPLITS["nonoverlap_imbalanced"])
    assert [c.group for c in imb] == [0] * 3 + [1] * 7 + [2] * 5  # 20 / 47 / 33 %, contiguous
    assert summarize(imb)["group_counts"] == {0: 3, 1: 7, 2: 5}
    assert all(h <= set(OCFL_CLASS_SETS[c.group]) for c, h in zip(imb, _held(imb)))
    assert _max_share(imb) > _max_share(bal) + 0.15  # Dirichlet(1) inside the set
    assert min(len(c.y_train) + len(c.y_test) for c in imb) >= 10
    ov = class_set_groups(images, labels, 30, **OCFL_SPLITS["overlap_imbalanced"])
    assert summarize(ov)["group_counts"] == {0: 6, 1: 14, 2: 10}
    assert all(h <= set(OCFL_OVERLAPPING_CLASS_SETS[c.group]) for c, h in zip(ov, _held(ov)))


def test_class_sets_samples_per_client():
    images, labels = _data(per_class=100)
    clients = class_set_groups(images, labels, 9, samples_per_client=40, test_fraction=0.25, seed=3)
    for c in clients:
        ys = _all_samples(c)[1]
        assert len(ys) == 40 and len(c.y_test) == 10
        hist = np.bincount(ys, minlength=10)[list(OCFL_CLASS_SETS[c.group])]
        assert sorted(hist.tolist(), reverse=True) == ([10] * 4 if c.group == 0 else [14, 13, 13])
    rows = np.concatenate(_source_rows(images, clients))
    assert len(rows) == len(set(rows.tolist())) == 360  # drawn without replacement across clients
    skewed = class_set_groups(images, labels, 9, samples_per_client=40, alpha=0.3, seed=3)
    assert all(len(_all_samples(c)[1]) == 40 for c in skewed) and _max_share(skewed) > _max_share(clients) + 0.2


def test_class_sets_seeded_and_custom_sets():
    images, labels = _data(per_class=60)
    for kw in ({}, {"alpha": 1.0}, {"samples_per_client": 20, "alpha": 1.0}):
        assert _same(class_set_groups(images, labels, 6, seed=4, **kw), class_set_groups(images, labels, 6, seed=4, **kw))
        assert not _same(class_set_groups(images, labels, 6, seed=4, **kw),
                         class_set_groups(images, labels, 6, seed=5, **kw))
    two = class_set_groups(images, labels, 4, class_sets=[[1, 0], [5]], group_shares=[0.5, 0.5], prefix="d")
    assert [c.group for c in two] == [0, 0, 1, 1] and [c.cid for c in two] == ["d00", "d01", "d02", "d03"]
    assert _held(two) == [{0, 1}, {0, 1}, {5}, {5}]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n_clients": 0}, "n_clients must be >= 1"),
        ({"class_sets": [[0, 1], [1, 2]]}, r"class_sets share classes \[1\] but overlapping=False"),
        ({"class_sets": [[0], [1]], "overlapping": True}, "overlapping=True but class_sets"),
        ({"overlapping": "yes"}, "overlapping must be True or False"),
        ({"class_sets": [[0], [10]]}, "class_sets entry 10 is not below num_classes=10"),
        ({"class_sets": [[0], []]}, "empty set"),
        ({"class_sets": [[0], [0]]}, "distinct sets"),
        ({"class_sets": [0, 1]}, "list of lists of classes"),
        ({"group_shares": [0.5, 0.5]}, "group_shares has 2 entries for 3 class sets"),
        ({"group_shares": [0.5, 0.6, 0.1]}, "group_shares must sum to 1"),
        ({"group_shares": [0.5, -0.1, 0.6]}, "group_shares must be positive"),
        ({"alpha": 0.0}, "alpha must be a positive"),
        ({"samples_per_client": 5}, "samples_per_client must be >= 10"),
        ({"samples_per_client": 40}, "the clients holding class 4 need 28 of its samples, there are 20"),
        ({"n_clients": 9, "min_size": 30}, "min_size=30: some client gets only 20 samples"),
        ({"test_fraction": 1.0}, "test_fraction must be in"),
        ({"num_classes": 5}, "labels must be below num_classes=5"),
    ],
)
def test_class_sets_bad_arguments_raise(kw, match):
    images, labels = _data(per_class=20)
    kw = {"n_clients": 6, **kw}
    with pytest.raises(ValueError, match=match):
        class_set_groups(images, labels, kw.pop("n_clients"), **kw)


def test_class_sets_refuse_a_class_without_samples():
    images, labels = _data(per_class=20)
    keep = labels != 7
    with pytest.raises(ValueError, match="class 7 of class_sets has no samples"):
        class_set_groups(images[keep], labels[keep], 6, num_classes=10)
