"""The device's part of secure aggregation (:mod:`edge_sdk.secure`): its update masked, its reveal.

A train command with a ``secure`` record names the round's peers of the
device's model (their public keys), the threshold and the quantiser. The
device clips its change from the round's model to ``clip``, rotates and
rounds it to ``bits``-bit integers (:class:`~edge_sdk.secure.SecureQuantizer`,
its own randomness), masks it (:class:`~edge_sdk.secure.DeviceSecureRound`)
and sends the masked update in place of its update. When the round closes,
the server's ``unmask`` command (its body the request) names the survivors;
the device answers with a ``REVEAL``. numpy and ``cryptography`` only: a
device without torch that trains elsewhere takes part the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..protocol import Kind
from ..protocol.commands import Op
from ..secure import DeviceSecureRound, SecureQuantizer, UnmaskRequest
from ..secure.params import params_from_command
from .commands import Command, DeviceContext, handles
from .state import DeviceState

__all__ = ["flat_change", "masked_update", "unmask"]

log = logging.getLogger("edge_sdk.client.commands")

#: Open rounds a device keeps (their reveal may be asked until the next ones open).
KEEP_ROUNDS = 4


def flat_change(weights: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> np.ndarray:
    """The change from the round's model, every tensor in name order, float32."""
    return np.concatenate([(np.asarray(weights[n], np.float32) - np.asarray(start[n], np.float32)).ravel()
                           for n in sorted(start)])


def masked_update(state: DeviceState, cid: str, fields: Mapping[str, Any], rnd: int, key: str,
                  weights: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> bytes:
    """The body of a secure update: the change quantised and masked; the round kept for its reveal."""
    x = flat_change(weights, start)
    params = params_from_command(fields, rnd, key, x.size)
    q, clipped = SecureQuantizer(fields["clip"], fields["bits"], params.ctx).encode(x, np.random.default_rng())
    part = DeviceSecureRound(state.secure_keys, cid, params)
    body = part.mask(q).to_bytes()
    rounds = state.secure_rounds
    rounds[(rnd, key)] = part
    for old in sorted(rounds)[:-KEEP_ROUNDS]:
        del rounds[old]
    log.info("round %d: update masked for %d peers (threshold %d, %d bits a value%s)", rnd, params.n,
             params.threshold, params.modulus_bits, ", clipped" if clipped else "")
    return body


@handles(Op.UNMASK)
def unmask(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Answer the server's unmask request of a round this device masked an update for."""
    m, link = cmd.fields, ctx.link
    rnd, key = m["round"], m["model_key"]
    part = state.secure_rounds.get((rnd, key))
    if part is None:
        log.warning("unmask for round %d, model %s: this device masked no update for it; ignored", rnd, key)
        return
    reveal = part.reveal(UnmaskRequest.from_bytes(cmd.body, part.params))
    link.send(link.topics.update(link.cid), Kind.REVEAL, rnd, {"round": rnd, "model_key": key}, reveal.to_bytes())
    log.info("round %d: revealed for %d survivors and %d dropped", rnd, len(reveal.b_shares),
             len(reveal.pair_seeds))
