"""FedCRef's association graph on the server: its edges, its communities, the stopping rule.

Pure functions on node ids ``"<cid>:<cluster>"`` (:func:`edge_sdk.fedcref.node_key`):
an edge joins two clusters whose association statistics are at most ``theta``
both ways (:func:`association_edges`), communities are the connected
components (:func:`connected_components`), and the federation stops when
their counts settle (:func:`stop_rule_met`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_sdk.fedcref import check_theta

__all__ = ["association_edges", "connected_components", "stop_rule_met", "wrong_associations"]


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
