"""The pure math of FLIS: predictions on the auxiliary set, their inference similarity, and the clusters cut from it.

``A_ij = <B_i, B_j>_F / (||B_i||_F ||B_j||_F)`` of the clients' prediction
matrices ``B`` (see :mod:`server_kit.strategies.flis`), FLIS-DC's
thresholding and FLIS-HC's hierarchical cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_sdk.validation import check_choice

from ..clustering.hierarchy import cut_tree

__all__ = [
    "LINKAGES",
    "PREDICTIONS",
    "cross_similarity",
    "distinct_clusters",
    "hierarchical_labels",
    "inference_similarity",
    "prediction_matrix",
    "softmax",
    "threshold_clusters",
]

#: What ``B_k`` holds: one-hot predicted classes or softmax probabilities.
PREDICTIONS: tuple[str, ...] = ("hard", "soft")
#: Linkages of :class:`~server_kit.strategies.flis.FLISHC` (scipy's names; the authors' code calls complete "maximum").
LINKAGES: tuple[str, ...] = ("complete", "average", "single")


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Row-wise ``softmax(logits / temperature)`` in float64 (max-subtracted, so no overflow)."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def prediction_matrix(probabilities: np.ndarray, kind: str = "hard") -> np.ndarray:
    """``B``: one-hot of the argmax (``"hard"``) or the probabilities themselves (``"soft"``).

    ``probabilities`` is ``(..., m, C)``; ties in the argmax go to the lower class.
    """
    p = np.asarray(probabilities, dtype=np.float64)
    if kind == "soft":
        return p
    if kind != "hard":
        raise ValueError(f"kind must be one of {PREDICTIONS}, got {kind!r}")
    return np.eye(p.shape[-1], dtype=np.float64)[np.argmax(p, axis=-1)]


def cross_similarity(b1: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """``(n1, n2)`` normalised Frobenius products of two stacks of ``(m, C)`` matrices.

    An all-zero matrix (which neither kind of prediction produces) is at
    similarity 0 from everything.
    """
    f1 = np.asarray(b1, dtype=np.float64).reshape(len(b1), -1)
    f2 = np.asarray(b2, dtype=np.float64).reshape(len(b2), -1)
    if f1.shape[1] != f2.shape[1]:
        raise ValueError(f"prediction matrices differ in size: {f1.shape[1]} vs {f2.shape[1]} values")
    n1, n2 = np.linalg.norm(f1, axis=1), np.linalg.norm(f2, axis=1)
    s = f1 @ f2.T
    s /= np.where(n1 > 0, n1, 1.0)[:, None]
    s /= np.where(n2 > 0, n2, 1.0)[None, :]
    return np.clip(s, 0.0, 1.0)


def inference_similarity(b: np.ndarray) -> np.ndarray:
    """FLIS's adjacency ``A_ij = <B_i, B_j>_F / (||B_i||_F ||B_j||_F)`` of ``(n, m, C)`` predictions.

    Symmetric, in ``[0, 1]`` for non-negative ``B``, with a unit diagonal
    (for non-zero ``B``). For one-hot ``B`` it is the agreement rate of the
    predicted classes.
    """
    a = np.asarray(b)
    if a.ndim != 3:
        raise ValueError(f"predictions must be a (clients, samples, classes) array, got shape {a.shape}")
    s = cross_similarity(a, a)
    s = (s + s.T) / 2.0
    norms = np.linalg.norm(a.reshape(len(a), -1), axis=1)
    np.fill_diagonal(s, np.where(norms > 0, 1.0, 0.0))
    return s


def threshold_clusters(similarity: np.ndarray, threshold: float) -> list[tuple[int, ...]]:
    """FLIS-DC's hard thresholding: for each client ``i``, ``C_i = {j : A_ij >= threshold}``.

    ``i`` is always in its own ``C_i``. Returns the sorted members of each
    ``C_i``, in the order of the rows; clusters may overlap.
    """
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"similarity must be a square matrix, got shape {s.shape}")
    out = []
    for i in range(s.shape[0]):
        members = set(np.flatnonzero(s[i] >= threshold).tolist()) | {i}
        out.append(tuple(sorted(members)))
    return out


def distinct_clusters(sets: Sequence[Sequence[int]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Label of each row's set among the distinct sets (numbered by first appearance), and those sets."""
    index: dict[tuple[int, ...], int] = {}
    labels = []
    for s in sets:
        key = tuple(sorted(int(j) for j in s))
        labels.append(index.setdefault(key, len(index)))
    return labels, list(index)


def hierarchical_labels(similarity: np.ndarray, distance_threshold: float, linkage: str = "complete") -> np.ndarray:
    """Agglomerative clusters of the distances ``1 - A`` cut at ``distance_threshold``.

    Two clusters merge while their ``linkage`` distance (complete: the
    largest pairwise distance; average; single: the smallest) is at most the
    threshold. Labels are 0-based, numbered by first appearance.
    """
    check_choice(linkage, "linkage", LINKAGES, LINKAGES)
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"similarity must be a square matrix, got shape {s.shape}")
    d = np.clip(1.0 - (s + s.T) / 2.0, 0.0, 1.0)
    np.fill_diagonal(d, 0.0)
    raw, _ = cut_tree(d, distance_threshold, linkage)
    order = {lab: k for k, lab in enumerate(dict.fromkeys(raw.tolist()))}
    return np.array([order[lab] for lab in raw.tolist()], dtype=np.int64)
