"""The in-process wire of :func:`~server_kit.fedcref.run_fedcref`: real envelopes, counted bytes.

Every exchanged object is encoded as a FedSketch envelope, counted in a
:class:`~server_kit.metrics.CommLedger` (chunk envelopes included) and
decoded back, as a broker would carry it.
"""

from __future__ import annotations

from edge_sdk.fedcref.client import Payload
from edge_sdk.protocol import (
    Kind,
    Message,
    decode_message,
    encode_message,
    parse_tensors,
    tensors_body,
)

from ..metrics import CommLedger

__all__ = ["Wire"]


class Wire:
    """Encode every exchanged object as a FedSketch envelope, count it, decode it back.

    Parameters
    ----------
    federation : str
        Federation id written in the envelopes.
    max_payload : int
        Largest MQTT payload; bigger envelopes are counted as their CHUNK
        envelopes (:func:`edge_sdk.protocol.split_payload`), as a broker with
        a 1 MB packet limit needs.

    Attributes
    ----------
    ledger : server_kit.metrics.CommLedger
        Bytes and messages per object type and direction ("up": client to
        broker, "down": broker to a client, one delivery per recipient).
    """

    def __init__(self, federation: str = "fedcref", max_payload: int = 1_000_000) -> None:
        self.federation = federation
        self.max_payload = int(max_payload)
        self.ledger = CommLedger()

    def send(self, kind: Kind, payload: Payload, *, sender: str, direction: str, recipients: int = 1,
             round: int = 0) -> Payload:
        """Encode ``payload``, count ``recipients`` deliveries, return the decoded copy."""
        meta, tensors = payload
        body = tensors_body(tensors) if tensors else b""
        out = Message(kind, self.federation, sender, int(round), dict(meta), body)
        nbytes = out.wire_size(self.max_payload)
        raw = encode_message(out)
        if recipients > 0:
            self.ledger.add(str(meta.get("type", kind.name.lower())), direction, nbytes, recipients)
        msg = decode_message(raw, expected_sender=sender, expected_federation=self.federation)
        return dict(msg.meta), (parse_tensors(msg.body) if msg.body else {})
