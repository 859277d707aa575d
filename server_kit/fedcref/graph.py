"""FedCRef's association graph on the server: its edges, its communities, the stopping rule.

Pure functions on node ids ``"<cid>:<cluster>"`` (:func:`edge_sdk.fedcref.node_key`):
an edge joins two clusters whose association statistics are at most ``theta``
both ways (:func:`association_edges`), communities are the connected
components (:func:`connected_components`), and the federation stops when
their counts settle (:func:`stop_rule_met`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from edge_sdk.fedcref import check_theta

__all__ = ["AssociationAudit", "association_audit", "association_edges", "community_links", "connected_components",
           "stop_rule_met", "wrong_associations", "wrong_community_links"]


def association_edges(stats: Mapping[str, Mapping[str, float]], theta: float) -> list[tuple[str, str]]:
    """Edges of the association graph: pairs whose statistics are at most ``theta`` both ways.

    Parameters
    ----------
    stats : mapping of node -> (mapping of node -> float)
        ``stats[a][b]``: the statistic computed by ``a``'s owner for its cluster
        ``a`` against the model of cluster ``b``. A missing direction means no
        edge.
    theta : float
        Association threshold in (0, 1].

    Returns
    -------
    list of (str, str)
        Sorted pairs ``(a, b)`` with ``a < b``.
    """
    t = check_theta(theta)
    edges = set()
    for a, row in stats.items():
        for b, s in row.items():
            if a == b or not s <= t:
                continue
            back = stats.get(b, {}).get(a)
            if back is not None and back <= t:
                edges.add((a, b) if a < b else (b, a))
    return sorted(edges)


def connected_components(nodes: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[list[str]]:
    """Connected components of an undirected graph (union-find).

    Returns
    -------
    list of list of str
        Each component's nodes sorted; components ordered by their first node.
    """
    parent = {n: n for n in nodes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in edges:
        if a not in parent or b not in parent:
            raise ValueError(f"edge ({a}, {b}) names a node that is not in the graph")
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[str, list[str]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def community_links(check: Mapping[str, Mapping[str, float]], groups: Mapping[str, Sequence[str]],
                    theta: float) -> list[tuple[str, str]]:
    """Pairs of communities whose models pass the community check both ways.

    Community ``a`` accepts community ``b`` when at least half of ``a``'s
    member clusters that reported find ``b``'s model within ``theta``
    (``check[node][b] <= theta``: the association statistic with ``a``'s
    model as the own one,
    :func:`edge_sdk.fedcref.association.community_check_matrix`); two
    communities link when each accepts the other. A vote of the members
    rather than one pair: a single impure member cannot join two categories.

    Parameters
    ----------
    check : mapping of node -> (mapping of community id -> float)
        Each member cluster's statistics against the community models.
    groups : mapping of str to sequence of str
        Member nodes of each community, by id ``"<g>"``.
    theta : float
        Association threshold in (0, 1].

    Returns
    -------
    list of (str, str)
        Sorted pairs ``(a, b)`` with ``a < b``.
    """
    t = check_theta(theta)

    def accepts(a: str, b: str) -> bool:
        votes = [check[k][b] <= t for k in groups[a] if k in check and b in check[k]]
        return bool(votes) and 2 * sum(votes) >= len(votes)

    ids = sorted(groups)
    return [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:] if accepts(a, b) and accepts(b, a)]


def stop_rule_met(communities: Sequence[int], isolated: Sequence[int], *, tolerance: float = 0.1,
                  patience: int = 3) -> bool:
    """The paper's global stopping rule.

    True when, over the last ``patience`` iterations, neither the number of
    communities nor the number of isolated clusters moved by more than
    ``tolerance`` of its largest value in that window (``max - min <=
    tolerance * max``; a window of zeros is stable).
    """
    if len(communities) != len(isolated):
        raise ValueError("communities and isolated histories differ in length")
    if len(communities) < patience:
        return False
    for series in (communities, isolated):
        w = np.asarray(series[-patience:], dtype=np.float64)
        if w.max() - w.min() > tolerance * w.max():
            return False
    return True


def wrong_associations(edges: Sequence[tuple[str, str]], node_class: Mapping[str, int]) -> int:
    """Edges joining clusters whose majority true classes differ (evaluation only)."""
    return int(sum(node_class[a] != node_class[b] for a, b in edges))


def wrong_community_links(links: Sequence[tuple[str, str]], groups: Mapping[str, Sequence[str]],
                          node_class: Mapping[str, int]) -> int:
    """Community-check links joining communities whose majority true classes differ (evaluation only).

    A community's class is the most common majority class of its member
    clusters (ties: the smallest class).
    """
    def majority(g: str) -> int:
        classes = [node_class[k] for k in groups[g] if k in node_class]
        return int(np.bincount(classes).argmax()) if classes else -1

    return int(sum(majority(a) != majority(b) for a, b in links))


@dataclass(frozen=True)
class AssociationAudit:
    """The association test's decisions of one iteration against the true classes (evaluation only).

    A pair is two clusters of different clients that tested each other (both
    directions reported); it is *same* when their majority true classes agree.
    The pair's score is the larger of its two statistics: it is linked when
    that score is at most ``theta``.

    Attributes
    ----------
    same_pairs, same_linked : int
        Same-class pairs, and how many of them the test linked (the rest are
        the missed links that split a class into several communities).
    diff_pairs, diff_linked : int
        Pairs of different classes, and how many the test linked (wrong links).
    same_score_median, diff_score_min : float
        Median score of the same-class pairs; lowest score of the others
        (NaN when there is no such pair).
    impure_nodes : int
        Clusters whose majority class holds less than ``purity_floor`` of their samples.
    wrong_impure : int
        Wrong links with at least one impure end.
    classes_split : int
        Classes whose clusters lie in more than one community (counting
        classes with a community only).
    """

    same_pairs: int
    same_linked: int
    diff_pairs: int
    diff_linked: int
    same_score_median: float
    diff_score_min: float
    impure_nodes: int
    wrong_impure: int
    classes_split: int

    def as_dict(self) -> dict[str, float]:
        """The fields as a JSON-ready mapping."""
        return asdict(self)


def association_audit(stats: Mapping[str, Mapping[str, float]], theta: float, node_class: Mapping[str, int],
                      node_purity: Mapping[str, float], communities: Sequence[Sequence[str]], *,
                      purity_floor: float = 0.8) -> AssociationAudit:
    """Score every tested pair of :func:`association_edges` against the clusters' true classes.

    Parameters
    ----------
    stats, theta
        As for :func:`association_edges`.
    node_class, node_purity : mapping of node -> int, float
        Majority true class of each cluster and the share of its samples in it.
    communities : sequence of sequence of str
        The communities formed from the same graph.
    purity_floor : float
        A cluster below this purity counts as impure.
    """
    t = check_theta(theta)
    same, diff = [], []
    wrong_impure = 0
    for a, row in stats.items():
        for b, s in row.items():
            back = stats.get(b, {}).get(a)
            if (not a < b or back is None or a.rsplit(":", 1)[0] == b.rsplit(":", 1)[0]
                    or a not in node_class or b not in node_class):
                continue
            score = max(float(s), float(back))
            if node_class[a] == node_class[b]:
                same.append(score)
            else:
                diff.append(score)
                if score <= t and min(node_purity[a], node_purity[b]) < purity_floor:
                    wrong_impure += 1
    same_a, diff_a = np.asarray(same), np.asarray(diff)
    homes: dict[int, set[int]] = {}
    for g, members in enumerate(communities):
        for k in members:
            if k in node_class:  # a node whose owner has no cluster of that number now
                homes.setdefault(node_class[k], set()).add(g)
    return AssociationAudit(
        same_pairs=int(same_a.size), same_linked=int((same_a <= t).sum()),
        diff_pairs=int(diff_a.size), diff_linked=int((diff_a <= t).sum()),
        same_score_median=float(np.median(same_a)) if same_a.size else float("nan"),
        diff_score_min=float(diff_a.min()) if diff_a.size else float("nan"),
        impure_nodes=int(sum(p < purity_floor for p in node_purity.values())),
        wrong_impure=wrong_impure,
        classes_split=int(sum(len(gs) > 1 for gs in homes.values())),
    )
