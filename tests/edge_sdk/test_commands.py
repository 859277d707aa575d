"""The command vocabulary: what the server builds is what the device parses, byte for byte."""

from __future__ import annotations

import re

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.client.commands import HANDLERS
from edge_sdk.protocol import Kind, Message, ProtocolError, decode_message, encode_message
from edge_sdk.protocol.commands import FIELDS, Op, build, parse
from edge_sdk.schema import COMMANDS
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker

from helpers import ARCH

FED = "cmds"

#: Every field of every command, with a value the device accepts.
EVERY_FIELD = {
    "hello": {},
    "stop": {"reason": "the server stopped", "failed": True, "run": "r1"},
    "leave": {"reason": "retired"},
    "assign": {"model_key": "c1", "follow": ["c1"]},
    "welcome": {"architecture": ARCH, "encoder": "digits_encoder", "num_classes": 10, "train": False, "run": "r1",
                "reason": "no torch on the device"},
    "refused": {"reason": "too few samples"},
    "sketch": {"encoder": "fedae", "num_classes": 10, "flip_prob": 0.2, "summary": "sketch", "params": {"w": 3}},
    "train": {"round": 2, "architecture": ARCH, "models": ["c0", "c1"], "evaluate_first": False, "epochs": 2,
              "lr": 0.01, "batch_size": 16, "optimizer": "sgd",
              "compress": {"method": "topk", "fraction": 0.01}, "partition": 3, "announce_above": 1000000,
              "secure": {"peers": {"c0": "00" * 32, "c1": "11" * 32}, "threshold": 2, "bits": 6, "clip": 5.0,
                         "run": "r1"}},
    "train_ae": {"round": 1, "architecture": "digits_ae", "epochs": 3, "lr": 0.002, "batch_size": 64},
    "evaluate": {"round": 3, "model_key": "c0", "architecture": ARCH, "fraction": 0.5, "seed": 7},
    "keep": {"round": 4, "run": "r1", "strategy": "ifca", "architecture": ARCH, "model_key": "c0", "choose": True,
             "models": {"c0": {"sha256": "ab" * 32, "round": 3, "accuracy": 0.9}}},
    "resend": {"round": 5},
    "unmask": {"round": 5, "model_key": "c0"},
}


def over_the_wire(meta: dict, rnd: int = 1) -> Message:
    return decode_message(encode_message(Message(Kind.CMD, FED, "server", rnd, meta)))


def test_the_vocabulary_is_the_schemas_and_names_every_command_once():
    assert FIELDS is COMMANDS  # one table of fields and defaults
    assert [op.value for op in Op] == list(COMMANDS)
    assert set(EVERY_FIELD) == set(COMMANDS)
    assert {op: set(fields) for op, fields in EVERY_FIELD.items()} == {op: set(f) for op, f in FIELDS.items()}
    assert set(HANDLERS) == set(Op) and all(callable(h) for h in HANDLERS.values())


def test_a_device_given_its_own_handler_runs_it_for_that_command_only():
    rng = np.random.default_rng(0)
    w = LocalWorker("c1", rng.random((12, 8, 8), dtype=np.float32), np.arange(12) % 10)
    seen = []

    def own_assign(state, cmd, ctx):
        seen.append((cmd.fields["model_key"], cmd.round, ctx.link.cid))

    ec = EdgeClient(MemoryTransport(MemoryBroker(), "c1", federation=FED), w, federation=FED,
                    handlers={**HANDLERS, Op.ASSIGN: own_assign})
    assert ec.handle(over_the_wire(build(Op.ASSIGN, model_key="c2"))) is True
    assert seen == [("c2", 1, "c1")] and ec.model_key is None  # its own handler, not the table's
    assert ec.handle(over_the_wire(build(Op.WELCOME, num_classes=7, architecture=ARCH))) is True
    assert ec.state.welcomed and ec.handled == {"assign": 1, "welcome": 1}


@pytest.mark.parametrize("op", list(Op))
def test_every_command_goes_from_the_builder_to_the_parser_unchanged(op):
    meta = build(op, **EVERY_FIELD[op.value])
    assert meta == {"op": op.value, **EVERY_FIELD[op.value]} and type(meta["op"]) is str
    assert parse(over_the_wire(meta)) == meta


@pytest.mark.parametrize("op", list(Op))
def test_the_parser_fills_in_the_defaults_of_what_the_builder_left_out(op):
    required = {k: v for k, v in EVERY_FIELD[op.value].items() if FIELDS[op.value][k].required}
    defaults = {k: f.default for k, f in FIELDS[op.value].items() if not f.required and f.default is not None}
    assert parse(over_the_wire(build(op.value, **required))) == {"op": op.value, **required, **defaults}


def test_the_sketch_defaults_live_in_the_schema():
    got = parse(over_the_wire(build(Op.SKETCH, num_classes=10)))
    assert got == {"op": "sketch", "encoder": "digits_encoder", "num_classes": 10, "flip_prob": 0.1,
                   "summary": "sketch", "params": {}}


def test_built_bytes_are_todays_literal_dict():
    meta = build(Op.TRAIN, round=3, models=["c0"], evaluate_first=True, epochs=1, lr=0.01, batch_size=32,
                 optimizer="adam")
    literal = {"op": "train", "round": 3, "models": ["c0"], "evaluate_first": True, "epochs": 1, "lr": 0.01,
               "batch_size": 32, "optimizer": "adam"}
    payload = encode_message(Message(Kind.CMD, FED, "server", 3, meta))
    assert payload == encode_message(Message(Kind.CMD, FED, "server", 3, literal))
    assert payload.endswith(b'{"op":"train","round":3,"models":["c0"],"evaluate_first":true,"epochs":1,'
                            b'"lr":0.01,"batch_size":32,"optimizer":"adam"}')


def test_the_builder_refuses_unknown_commands_and_fields():
    ops = re.escape(str(sorted(COMMANDS)))
    with pytest.raises(ValueError, match=f"^unknown command 'nope'; the commands are {ops}$"):
        build("nope")
    with pytest.raises(ValueError, match=r"^command 'stop' has no field 'why'; its fields are \['failed', 'reason', 'run'\]$"):
        build(Op.STOP, why="done")
    with pytest.raises(ValueError, match=r"^command 'assign' has no field 'op'; its fields are "
                                         r"\['follow', 'model_key'\]$"):
        build("assign", model_key="c0", op="stop")
    with pytest.raises(ValueError, match=r"^command 'train' needs the field 'models'$"):
        build(Op.TRAIN, round=1)


def test_the_parser_refuses_unknown_ops_and_bad_types_with_the_schemas_words():
    ops = re.escape(str(sorted(COMMANDS)))
    with pytest.raises(ProtocolError, match=f"^meta field 'op' must be one of {ops}, got 'nope'$") as e:
        parse(over_the_wire({"op": "nope"}))
    assert e.value.reason == "meta-field"
    with pytest.raises(ProtocolError, match=r"^meta field 'round' must be an integer in \[0, 4\.29497e\+09\], "
                                            r"got '1'$"):
        parse(over_the_wire({"op": "train", "round": "1", "models": ["c0"]}))
    with pytest.raises(ProtocolError, match=r"^meta field 'reason' is missing$"):
        parse(over_the_wire({"op": "refused"}))
    # a field the command does not declare is dropped, not refused (a newer server may add one)
    assert parse(over_the_wire({"op": "stop", "reason": "x", "later": 1})) == {"op": "stop", "reason": "x",
                                                                                 "failed": False}


def test_the_client_dispatches_parsed_commands_and_counts_refused_ones():
    rng = np.random.default_rng(0)
    w = LocalWorker("c1", rng.random((12, 8, 8), dtype=np.float32), np.arange(12) % 10)
    ec = EdgeClient(MemoryTransport(MemoryBroker(), "c1", federation=FED), w, federation=FED)
    assert ec.handle(over_the_wire({"op": "nope"})) is True
    assert ec.rejected == {"meta-field": 1} and ec.handled == {}
    assert ec.handle(over_the_wire(build(Op.WELCOME, num_classes=7, architecture=ARCH))) is True
    assert ec.worker.num_classes == 7 and ec.state.welcomed
    assert ec.handle(over_the_wire(build(Op.ASSIGN, model_key="c2"))) is True and ec.model_key == "c2"
    assert ec.handle(over_the_wire(build(Op.REFUSED, reason="no"))) is False
    assert (ec.exit_code, ec.refused_reason) == (4, "no")
    assert ec.handle(over_the_wire(build(Op.STOP))) is False
    assert ec.handled == {"welcome": 1, "assign": 1, "refused": 1, "stop": 1}
