"""The device's sketch: sent when asked (or unasked when its data moved), what it gives away logged, and its
owner's budget kept (``fedsketch-client --max-sketch-epsilon``)."""

from __future__ import annotations

import logging

import numpy as np

from ..privacy import SketchOverBudget, sketch_epsilon
from ..protocol import Kind, sketch_body, tensors_body
from ..protocol.commands import Op
from .commands import Command, DeviceContext, handles
from .state import DeviceState

__all__ = ["apply_data_change", "sketch", "spend_sketch_budget"]

log = logging.getLogger("edge_sdk.client.commands")


@handles(Op.SKETCH)
def sketch(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Send the sketch of the local data (or the float summary the command names)."""
    m, rnd, link = cmd.fields, cmd.round, ctx.link
    if cmd.broadcast and not state.welcomed:
        log.debug("sketch request for admitted devices: not admitted yet, ignored")
        return
    kind = m["summary"]
    if kind != "sketch":
        from ..features import SUMMARIES

        if kind not in SUMMARIES:
            raise ValueError(f"unknown summary kind {kind!r}; this client knows {sorted(SUMMARIES)}")
        feats = SUMMARIES[kind](ctx.worker.x, ctx.worker.y, num_classes=m["num_classes"], **m["params"])
        link.send(link.topics.sketch(link.cid), Kind.FEATURES, rnd, {"summary": kind},
                  tensors_body({"features": np.ascontiguousarray(feats, dtype=np.float32)}))
        log.info("sent %s summary %s", kind, feats.shape)
        return
    encoder = state.encoders.get(m["encoder"], wait_s=ctx.model_timeout_s)
    sketcher = ctx.drift.sketcher(encoder, m["num_classes"], m["flip_prob"])
    if not spend_sketch_budget(ctx, sketcher.flip_prob, sketcher.num_classes, sketcher.latent_dim, rnd):
        return
    sk = ctx.worker.sketch(sketcher)
    link.send(link.topics.sketch(link.cid), Kind.SKETCH, rnd, body=sketch_body(sk))
    ctx.drift.sent(sk)
    log.info("sent sketch (%d bits, %d bytes)", sk.n_bits, sk.nbytes)



def apply_data_change(ctx: DeviceContext) -> None:
    """Take the data :meth:`edge_sdk.client.EdgeClient.data_changed` offered, if any; send its sketch unasked
    if it changed enough."""
    data = ctx.drift.take()
    if data is None:
        return
    worker, link = ctx.worker, ctx.link
    try:
        worker.replace_data(*data)
        watch = ctx.drift.watch
        if watch is None or watch.last is None:
            log.info("local data changed (%d samples); no sketch sent yet: nothing to tell", len(worker.y))
            return
        new = watch.check(worker.x, worker.y)
        if new is None:
            log.info("local data changed (%d samples), within the flip noise of the last sketch sent "
                     "(%.1f bits): not told", len(worker.y), watch.threshold_bits)
            return
        bits = watch.last.hamming(new)
        if not spend_sketch_budget(ctx, new.flip_prob, new.num_classes, new.latent_dim, 0):
            return
        link.send(link.topics.sketch(link.cid), Kind.SKETCH, meta={"unasked": True}, body=sketch_body(new))
    except (ValueError, TypeError, ConnectionError) as e:  # the device keeps serving
        log.error("local data change: %s", e)
        return
    ctx.drift.sent(new)
    ctx.drift.unasked += 1
    log.info("local data changed: sketch sent unasked (%d bits from the last one sent, noise threshold %.1f)",
             bits, watch.threshold_bits)


def spend_sketch_budget(ctx: DeviceContext, flip_prob: float, num_classes: int, latent_dim: int, rnd: int) -> bool:
    """Log what the sketch about to go gives away; False (the server told, nothing sent) past the owner's budget."""
    eps = sketch_epsilon(flip_prob, num_classes, latent_dim)
    budget = ctx.sketch_budget
    if budget is not None:
        try:
            budget.spend(eps)
        except SketchOverBudget as e:
            log.warning("%s", e)
            link = ctx.link
            link.send(link.topics.status(link.cid), Kind.STATUS, rnd, {"state": "online", "declined": "sketch"})
            return False
    spent = "" if budget is None else f"; spent {budget.spent:.1f} of the budget {budget.max_epsilon:g}"
    log.info("%s%s", eps.describe(), spent)
    return True
