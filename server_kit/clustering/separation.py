"""Are two groups of sketches two clusters, or one cluster cut in two?

Ward's dendrogram cuts anything in two, and a permutation test of "no
structure" only says *some* structure is there: with enough clients it also
finds the continuum inside one true group (clients with fewer samples have
noisier class means; classes missing on some clients), and splits it. That is
why the auto-K choice degraded with the fleet's size (issue 13: 18 clusters
instead of 4 at 1,000 devices). What tells the two apart is an effect size,
not a p-value: two real clusters stay apart along the line that joins them,
one blob cut in two does not.

The measure, :func:`separation`: the members of both groups are dealt into
folds; for each fold, the direction is the difference of the two groups' mean
bit vectors without that fold, and the fold's members are projected on it;
the pooled held-out projection is cut in two by one-dimensional 2-means (so
the members' own labels, which Ward chose with them in view, play no part). The separation is the distance between the two sides' means in units
of their pooled standard deviation (Ashman's D, with the 2-means cut).

* A single Gaussian blob cut at its mean gives D = 2 * sqrt(2/pi) /
  sqrt(1 - 2/pi) = 2.65 (both halves are truncated normals) however many
  clients there are; a uniform continuum gives about 3.5.
* Two clusters as far apart as the digits rotated by 90 and 270 degrees (the
  closest pair of the fleet benchmark) give about 8, at any fleet size.

:data:`MIN_SEPARATION` (5.0) lies between the two. Held-out projection removes
the bias of fitting a direction in 200 dimensions to a few dozen clients,
where any cut looks clean (the bias that lets a permutation test pass).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MIN_SEPARATION", "MIN_SIDE", "SEPARATION_SAMPLE", "merge_inseparable", "separation", "two_means_1d"]

#: Default smallest separation (Ashman's D on the held-out projection) for
#: two groups to stay two clusters.
MIN_SEPARATION = 5.0

#: Members of each group the measure looks at, at most (a seeded subset):
#: the estimate's error is already a few hundredths at this size.
SEPARATION_SAMPLE = 2000

#: Fewest members on each side for the measure. Over-splitting is a large-
#: sample failure (the permutation test's power grows with the clients), while
#: below this size a direction fitted to the others' means is too noisy and D
#: reads low for real pairs (3.6 to 4.7 for OCFL groups of 3 to 10 Fashion-
#: MNIST clients): smaller pairs are left to the permutation test alone.
MIN_SIDE = 20

#: Folds of the cross-fitted projection (fewer when a side is smaller).
_FOLDS_MAX = 5

#: Random fold assignments per measure; the median of their D is kept.
_REPEATS = 3


def two_means_1d(values: np.ndarray) -> tuple[float, float]:
    """Best cut of 1-D values into two groups (least within sum of squares).

    Returns ``(d, fraction)``: Ashman's D of the two sides (difference of
    means over the pooled standard deviation; ``inf`` when both sides are
    constant) and the share of the variance between them. Exact, O(n log n):
    every cut of the sorted values is scored from prefix sums.
    """
    s = np.sort(np.asarray(values, dtype=np.float64).ravel())
    n = s.size
    if n < 2:
        raise ValueError(f"two_means_1d needs at least 2 values, got {n}")
    s = s - s.mean()
    total = float(s @ s)
    if total <= 0:
        return 0.0, 0.0
    k = np.arange(1, n)  # size of the lower side
    c1 = np.cumsum(s)[:-1]
    between = c1 * c1 * n / (k * (n - k))  # mean of the total is 0
    i = int(np.argmax(between))
    lo, hi = s[: i + 1], s[i + 1 :]
    within = float(((lo - lo.mean()) ** 2).sum() + ((hi - hi.mean()) ** 2).sum())
    pooled = within / max(n - 2, 1)
    gap = float(hi.mean() - lo.mean())
    d = np.inf if pooled <= 0 else gap / np.sqrt(pooled)
    return float(d), float(between[i] / total)


def _subset(rows: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    return rows if rows.shape[0] <= size else rows[np.sort(rng.choice(rows.shape[0], size, replace=False))]


def separation(a: np.ndarray, b: np.ndarray, rng: np.random.Generator,
               sample: int = SEPARATION_SAMPLE) -> float:
    """Ashman's D of groups ``a`` and ``b`` (rows of 0/1 bits) on a held-out projection.

    Cross-fitted: the members of each side are dealt into up to
    :data:`_FOLDS_MAX` folds, every member is projected on the direction
    fitted without its fold, and the median D over :data:`_REPEATS` random
    deals is returned. ``inf`` when a side has fewer than :data:`MIN_SIDE`
    members: such a pair is judged by the permutation test alone.
    """
    a = _subset(np.asarray(a), sample, rng)
    b = _subset(np.asarray(b), sample, rng)
    if min(a.shape[0], b.shape[0]) < MIN_SIDE:
        return float("inf")
    folds = _FOLDS_MAX
    ds = []
    for _ in range(_REPEATS):
        fa = rng.permutation(a.shape[0]) % folds  # every fold holds members of both sides
        fb = rng.permutation(b.shape[0]) % folds
        proj = []
        for f in range(folds):  # each member projected on a direction fitted without it
            w = a[fa != f].mean(axis=0, dtype=np.float64) - b[fb != f].mean(axis=0, dtype=np.float64)
            proj += [a[fa == f] @ w, b[fb == f] @ w]
        ds.append(two_means_1d(np.concatenate(proj))[0])
    return float(np.median(ds))


def merge_inseparable(bits: np.ndarray, labels: np.ndarray, min_separation: float,
                      rng: np.random.Generator, sample: int = SEPARATION_SAMPLE) -> tuple[np.ndarray, list[dict]]:
    """Merge clusters that are not separated, nearest centroids first.

    Pairs are examined in order of the squared distance between their mean
    bit vectors; the first pair whose :func:`separation` is below
    ``min_separation`` is merged and the order recomputed, until every pair
    examined is separated. Returns the labels (a merged cluster keeps the
    label of its first part: renumber them if 0..k-1 is needed) and one ``{"clusters", "sizes", "separation", "merged"}`` per
    pair examined.
    """
    lab = np.asarray(labels).copy()
    log: list[dict] = []
    judged: dict[tuple[int, int], float] = {}
    while True:
        ids = np.unique(lab)
        if ids.size < 2:
            break
        members = {int(c): np.flatnonzero(lab == c) for c in ids}
        cents = np.stack([bits[members[int(c)]].mean(axis=0, dtype=np.float64) for c in ids])
        sq = (cents * cents).sum(axis=1)
        d2 = sq[:, None] + sq[None, :] - 2 * cents @ cents.T
        iu, ju = np.triu_indices(ids.size, k=1)
        merged = False
        for p in np.argsort(d2[iu, ju], kind="stable"):
            ci, cj = int(ids[iu[p]]), int(ids[ju[p]])
            key = (ci, cj)
            if key not in judged:
                judged[key] = separation(bits[members[ci]], bits[members[cj]], rng, sample)
                log.append({"clusters": [ci, cj], "sizes": [int(members[ci].size), int(members[cj].size)],
                            "separation": judged[key], "merged": judged[key] < min_separation})
            if judged[key] < min_separation:
                lab[members[cj]] = ci
                judged = {k: v for k, v in judged.items() if ci not in k and cj not in k}
                merged = True
                break
        if not merged:
            break
    return lab, log
