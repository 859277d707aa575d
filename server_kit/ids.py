"""How a log line names many devices: the first few ids, and how many in all."""

from __future__ import annotations

__all__ = ["some_ids"]


def some_ids(cids: list[str], shown: int = 20) -> str:
    """The first ``shown`` ids for a log line (a fleet's worth would flood the log)."""
    return ", ".join(cids[:shown]) + (f" ... ({len(cids)} in all)" if len(cids) > shown else "")
