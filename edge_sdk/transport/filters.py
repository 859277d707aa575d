"""MQTT topic names and filters: whether a topic matches a filter, and the checks both transports make."""

from __future__ import annotations

__all__ = ["check_filter", "check_topic", "topic_matches"]


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether an MQTT topic matches a subscription filter (``+`` and ``#``).

    ``a/#`` also matches ``a``; wildcards at the first level do not match
    topics that start with ``$``.
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return i == len(f_levels) - 1
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


def check_filter(topic_filter: str) -> str:
    """Return ``topic_filter`` if it is a valid subscription filter; raise ``ValueError`` naming the fault."""
    if not isinstance(topic_filter, str) or not topic_filter:
        raise ValueError(f"topic filter must be a non-empty string, got {topic_filter!r}")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"'#' must be a whole last level in filter {topic_filter!r}")
        if "+" in level and level != "+":
            raise ValueError(f"'+' must be a whole level in filter {topic_filter!r}")
    return topic_filter


def check_topic(topic: str) -> str:
    """Return ``topic`` if one may publish on it (non-empty, no wildcards); raise ``ValueError`` otherwise."""
    if not isinstance(topic, str) or not topic or "+" in topic or "#" in topic:
        raise ValueError(f"publish topic must be a non-empty string without wildcards, got {topic!r}")
    return topic

