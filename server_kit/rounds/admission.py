"""The one admission of a round's update: the server's intake and the ingest workers ask the same questions.

An update (its checked meta) is refused, with a :class:`~edge_sdk.protocol.ProtocolError`
whose reason both sides count and log alike, when

- ``stale-update``: no round is open, the update names another round, or its
  device was not tasked in it;
- ``wrong-model``: it names a model its device was not sent;
- ``wrong-version``: it starts from another version of that model than the
  round's (compressed updates only: :meth:`~edge_sdk.compress.update_codec.UpdateCodec.check_version`);
- ``duplicate-update``: a second update from the device this round.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from edge_sdk.compress.update_codec import UpdateCodec
from edge_sdk.protocol import ProtocolError

__all__ = ["admit_update"]


def admit_update(cid: str, meta: Mapping[str, Any], *, open_round: int | None, tasked: bool,
                 allowed: Collection[str], version_of: Callable[[str], int | None], codec: UpdateCodec,
                 held: bool) -> None:
    """Refuse (raise) or admit ``cid``'s update for the round ``open_round`` (None: none open).

    ``allowed``: the models the device was sent; ``version_of(key)``: the
    round's version of a model; ``held``: whether the round holds an update
    of this device already.
    """
    rnd = meta["round"]
    if open_round is None or rnd != open_round or not tasked:
        raise ProtocolError("stale-update", f"update for round {rnd} (open: {open_round}, tasked: {tasked})")
    key = meta.get("model_key")
    if key not in allowed:
        raise ProtocolError("wrong-model", f"update for model {key!r} in round {rnd}; this client was sent "
                                           f"{sorted(allowed)}")
    codec.check_version(key, meta.get("version"), version_of(key))
    if held:
        raise ProtocolError("duplicate-update", f"a second update from {cid} in round {rnd}")
