"""Secure aggregation's pure core: keys, Shamir, PRG, packing, a whole round, the wire format, the quantiser."""

from __future__ import annotations

import hashlib
import itertools
import re
import struct

import numpy as np
import pytest

from edge_sdk.secure import (
    DeviceKeys,
    DeviceSecureRound,
    MaskedUpdate,
    Reveal,
    SecureError,
    SecureParams,
    SecureQuantizer,
    ServerSecureRound,
    UnmaskRequest,
    default_threshold,
    mask_seed,
    modulus_bits_for,
    pack_bits,
    packed_size,
    pair_secret,
    prg,
    round_context,
    round_sizes,
    share_key,
    to_signed,
    unpack_bits,
)
from edge_sdk.secure.shamir import (
    PRIME,
    lagrange_at,
    reconstruct,
    share_from_bytes,
    share_to_bytes,
    split,
)

CTX = round_context("run-1", 7, "cluster-0")
KEYS = {f"d{i:02d}": DeviceKeys.from_private_bytes(hashlib.sha256(b"key %d" % i).digest()) for i in range(13)}


def make_params(n: int, m: int = 12, length: int = 257, t: int | None = None, ctx: bytes = CTX) -> SecureParams:
    ids = sorted(KEYS)[:n]
    return SecureParams(ctx, tuple((d, KEYS[d].public_bytes) for d in ids),
                        default_threshold(n) if t is None else t, m, length)


def make_devices(params: SecureParams, seed: int = 0) -> dict[str, DeviceSecureRound]:
    return {d: DeviceSecureRound(KEYS[d], d, params, np.random.default_rng([seed, i]).bytes)
            for i, d in enumerate(params.ids)}


def updates(params: SecureParams, seed: int = 1) -> dict[str, np.ndarray]:
    """Each device's q, as large as the sum of all of them allows."""
    top = 2 ** (params.modulus_bits - 1) // params.n
    rng = np.random.default_rng(seed)
    return {d: rng.integers(-top, top, params.length) for d in params.ids}


def check(raised, reason: str) -> None:
    assert raised.value.reason == reason


# --- keys and the round's context ---------------------------------------------------------------------

def test_the_round_context_is_length_prefixed_so_fields_cannot_slide():
    assert round_context("a", 1, "bc") != round_context("ab", 1, "c")
    assert round_context("run", 2, "m") == b"\x00\x03run" + struct.pack(">Q", 2) + b"\x00\x01m"
    with pytest.raises(ValueError, match="round_"):
        round_context("run", -1, "m")


def test_pair_secrets_are_symmetric_and_each_round_derives_other_seeds():
    a, b = KEYS["d00"], KEYS["d01"]
    k = pair_secret(a, b.public_bytes)
    assert k == pair_secret(b, a.public_bytes) and len(k) == 32
    assert DeviceKeys.from_private_bytes(a.private_bytes).public_bytes == a.public_bytes
    other = round_context("run-1", 8, "cluster-0")
    seeds = {mask_seed(k, CTX), mask_seed(k, other), share_key(k, CTX), share_key(k, other), k}
    assert len(seeds) == 5
    with pytest.raises(SecureError, match="low-order point") as raised:
        pair_secret(a, bytes(32))
    check(raised, "key")


def test_the_round_parameters_refuse_what_a_server_could_get_wrong():
    good = make_params(3)
    assert good.n == 3 and good.index("d02") == 2 and good.threshold == 2 == default_threshold(3)
    cases = [
        (dict(peers=tuple(reversed(good.peers))), "peer",
         "peers must be sorted by id with no id twice: 'd02' before 'd01'"),
        (dict(peers=good.peers[:1]), "peer", "a round needs 2 to 65535 peers, got 1"),
        (dict(peers=(("d00", b"x" * 31), good.peers[1])), "length", "the public key of 'd00' must be 32 bytes"),
        (dict(threshold=1), "threshold", "threshold must be an integer in [2, 3], got 1"),
        (dict(threshold=4), "threshold", "threshold must be an integer in [2, 3], got 4"),
        (dict(modulus_bits=33), "range", "modulus_bits must be an integer in [8, 32], got 33"),
        (dict(length=0), "length", "length must be an integer in [1, 2**31], got 0"),
    ]
    for change, reason, message in cases:
        fields = dict(ctx=good.ctx, peers=good.peers, threshold=good.threshold, modulus_bits=12, length=5) | change
        with pytest.raises(SecureError, match=f"^{re.escape(message)}$") as raised:
            SecureParams(**fields)
        check(raised, reason)


# --- Shamir -------------------------------------------------------------------------------------------

def test_any_t_of_n_shares_rebuild_the_secret_and_t_minus_1_do_not():
    secret = bytes(range(32))
    shares = split(secret, 5, 3, np.random.default_rng(3).bytes)
    points = {x: y for x, y in enumerate(shares, start=1)}
    for subset in itertools.combinations(points, 3):
        assert reconstruct({x: points[x] for x in subset}, 3) == secret
    assert reconstruct(points, 3) == secret  # all five, the two extra checked
    for subset in itertools.combinations(points, 2):
        assert lagrange_at({x: points[x] for x in subset}, 0) != int.from_bytes(secret, "big")
    with pytest.raises(SecureError, match="^2 shares, 3 needed$") as raised:
        reconstruct({1: points[1], 2: points[2]}, 3)
    check(raised, "threshold")
    points[4] = (points[4] + 1) % PRIME
    with pytest.raises(SecureError, match="^the share at x=4 does not lie on the polynomial of the first 3$") as raised:
        reconstruct(points, 3)
    check(raised, "share")


def test_hostile_share_bytes_are_refused():
    assert share_from_bytes(share_to_bytes(PRIME - 1)) == PRIME - 1
    for data, reason, message in [(bytes(65), "length", "a share is 66 bytes, got 65"),
                                  (bytes(67), "length", "a share is 66 bytes, got 67"),
                                  (PRIME.to_bytes(66, "big"), "range", "a share is not below the prime 2**521 - 1"),
                                  (b"\xff" * 66, "range", "a share is not below the prime 2**521 - 1")]:
        with pytest.raises(SecureError, match=f"^{re.escape(message)}$") as raised:
            share_from_bytes(data)
        check(raised, reason)
    # shares of a "secret" of more than 32 bytes: refused when rebuilt
    big = {x: (2 ** 300 + 5 * x) % PRIME for x in (1, 2)}
    with pytest.raises(SecureError, match="^the shares give a secret of more than 32 bytes$"):
        reconstruct(big, 2)


# --- PRG and packing ----------------------------------------------------------------------------------

def test_the_prg_is_deterministic_in_range_and_differs_by_seed():
    a, b = prg(b"\x01" * 32, 10_000, 12), prg(b"\x02" * 32, 10_000, 12)
    assert a.dtype == np.uint32 and np.array_equal(a, prg(b"\x01" * 32, 10_000, 12))
    assert a.max() < 4096 and (a == b).mean() < 0.01
    assert abs(a.mean() / 4095 - 0.5) < 0.02
    full = prg(b"\x01" * 32, 100, 32)
    assert np.array_equal(full & 0xFFF, prg(b"\x01" * 32, 100, 12))


@pytest.mark.parametrize("m", range(8, 33))
def test_pack_unpack_is_exact_for_every_m(m):
    rng = np.random.default_rng(m)
    for n in (1, 7, 333):
        values = rng.integers(0, 2 ** m, n, dtype=np.int64)
        values[0] = 2 ** m - 1
        data = pack_bits(values, m)
        assert len(data) == packed_size(n, m) == -(-n * m // 8)
        assert np.array_equal(unpack_bits(data, n, m), values)


def test_the_bit_layout_is_little_endian_and_the_padding_must_be_zero():
    assert pack_bits(np.array([0xABC, 0x123]), 12) == bytes([0xBC, 0x3A, 0x12])
    assert pack_bits(np.array([1, 2, 3]), 9) == (1 | 2 << 9 | 3 << 18).to_bytes(4, "little")
    with pytest.raises(SecureError, match=r"^3 entries of 9 bits are 4 bytes, got 5$") as raised:
        unpack_bits(bytes(5), 3, 9)
    check(raised, "length")
    with pytest.raises(SecureError, match=r"^the 5 unused bits of the last byte are not zero$") as raised:
        unpack_bits(bytes([0, 0, 0, 0x20]), 3, 9)
    check(raised, "padding")
    with pytest.raises(ValueError, match=r"lie in \[0, 2\*\*9\)"):
        pack_bits(np.array([512]), 9)
    assert np.array_equal(to_signed(np.array([0, 2047, 2048, 4095]), 12), [0, 2047, -2048, -1])


# --- a whole round ------------------------------------------------------------------------------------

def run_round(params, devices, q, senders, revealers, via_bytes=True):
    """Every message through its bytes; returns the server."""
    server = ServerSecureRound(params)
    for d in senders:
        msg = devices[d].mask(q[d])
        server.add_masked(msg.to_bytes() if via_bytes else msg)
    requests = server.close()
    for w in revealers:
        request = UnmaskRequest.from_bytes(requests[w].to_bytes(), params) if via_bytes else requests[w]
        answer = devices[w].reveal(request)
        server.add_reveal(answer.to_bytes() if via_bytes else answer)
    return server


ROUNDS = [(n, m, drop) for n in (2, 5, 13) for m in (8, 12, 32)
          for drop in sorted({0, min(1, n - default_threshold(n)), n - default_threshold(n)})]


@pytest.mark.parametrize(("n", "m", "drop"), ROUNDS)
def test_a_round_unmasks_exactly_the_sum_of_the_survivors(n, m, drop):
    params = make_params(n, m)
    devices, q = make_devices(params, seed=n * 100 + m), updates(params, seed=drop)
    gone = set(np.random.default_rng(drop + n).choice(params.ids, drop, replace=False))
    alive = [d for d in params.ids if d not in gone]
    server = run_round(params, devices, q, alive, alive)
    assert server.survivors == tuple(alive) and set(server.dropped) == gone and server.ready
    total = server.unmask()
    assert total.dtype == np.int64
    assert np.array_equal(total, sum(q[d] for d in alive))
    sizes = {d: round_sizes(params, d, alive) for d in alive}
    assert server.bytes_in == sum(s.up for s in sizes.values())
    assert server.bytes_out == sum(s.down for s in sizes.values())


def test_a_silent_survivor_is_fine_with_t_reveals_when_nobody_dropped():
    params = make_params(5)  # t = 3
    devices, q = make_devices(params, 5), updates(params, 5)
    server = run_round(params, devices, q, params.ids, params.ids[:3], via_bytes=False)
    assert server.ready and np.array_equal(server.unmask(), sum(q.values()))  # the silent ones counted


def test_fewer_than_t_reveals_cannot_unmask():
    params = make_params(5)
    devices, q = make_devices(params, 6), updates(params, 6)
    server = run_round(params, devices, q, params.ids, params.ids[:2], via_bytes=False)
    assert not server.ready
    with pytest.raises(SecureError, match="^2 reveals, fewer than the threshold 3$") as raised:
        server.unmask()
    check(raised, "threshold")


def test_with_a_dropped_device_every_survivor_must_reveal():
    params = make_params(5)
    devices, q = make_devices(params, 7), updates(params, 7)
    alive = params.ids[1:]
    server = run_round(params, devices, q, alive, alive[:3], via_bytes=False)
    assert not server.ready
    with pytest.raises(SecureError, match="^'d04' sent no reveal: its pair masks with the dropped 'd00' "
                                          "cannot be removed$") as raised:
        server.unmask()
    check(raised, "missing")
    server.add_reveal(devices["d04"].reveal(server.requests["d04"]))
    assert server.ready and np.array_equal(server.unmask(), sum(q[d] for d in alive))


def test_fewer_than_t_masked_updates_lose_the_round():
    params = make_params(5)
    devices, q = make_devices(params, 8), updates(params, 8)
    server = ServerSecureRound(params)
    for d in params.ids[:2]:
        server.add_masked(devices[d].mask(q[d]))
    with pytest.raises(SecureError, match="^2 masked updates, fewer than the threshold 3: the round cannot be "
                                          "unmasked$") as raised:
        server.close()
    check(raised, "threshold")


def test_the_server_refuses_a_stranger_a_second_update_a_lying_share_and_a_reveal_before_the_close():
    params = make_params(4)  # t = 3
    devices, q = make_devices(params, 9), updates(params, 9)
    server = ServerSecureRound(params)
    first = devices["d00"].mask(q["d00"])
    with pytest.raises(SecureError, match="^masked update: 'zz' is not a peer of this round$") as raised:
        server.add_masked(MaskedUpdate("zz", first.y, first.shares))
    check(raised, "peer")
    with pytest.raises(SecureError, match="^masked update: y holds 385 bytes, expected 386 for 257 entries of "
                                          "12 bits$") as raised:
        server.add_masked(MaskedUpdate("d00", first.y[:-1], first.shares))
    check(raised, "length")
    server.add_masked(first)
    with pytest.raises(SecureError, match="^masked update: a second one from 'd00'$") as raised:
        server.add_masked(first.to_bytes())
    check(raised, "again")
    for d in params.ids[1:]:
        server.add_masked(devices[d].mask(q[d]))
    with pytest.raises(RuntimeError, match="already masked"):
        devices["d01"].mask(q["d01"])
    requests = server.close()
    answers = {w: devices[w].reveal(requests[w]) for w in params.ids}
    lie = answers["d03"].b_shares | {"d00": share_to_bytes(share_from_bytes(answers["d03"].b_shares["d00"]) + 1)}
    for w in params.ids[:3]:
        server.add_reveal(answers[w])
    with pytest.raises(SecureError, match="^reveal: a second one from 'd00'$"):
        server.add_reveal(answers["d00"])
    server.add_reveal(Reveal("d03", lie, {}))
    with pytest.raises(SecureError, match="^the shares of 'd00''s self-mask seed: the share at x=4 does not lie "
                                          "on the polynomial of the first 3$") as raised:
        server.unmask()
    check(raised, "share")
    early = ServerSecureRound(params)
    with pytest.raises(SecureError, match="^reveal: from 'd00' before the round is closed and unmaskable$") as raised:
        early.add_reveal(answers["d00"])
    check(raised, "order")


def test_a_device_checks_every_request_before_it_reveals():
    params = make_params(5)
    devices, q = make_devices(params, 10), updates(params, 10)
    alive = params.ids[:4]
    server = ServerSecureRound(params)
    for d in alive:
        server.add_masked(devices[d].mask(q[d]))
    good = server.close()["d00"]
    swapped = dict(good.shares_for_you)
    swapped["d01"] = server.requests["d02"].shares_for_you["d01"]  # addressed to d02
    flipped = dict(good.shares_for_you)
    flipped["d02"] = flipped["d02"][:-1] + bytes([flipped["d02"][-1] ^ 1])
    cases = [
        (UnmaskRequest(good.survivors + ("zz",), good.dropped, good.shares_for_you), "peer",
         "unmask request: 'zz' is not a peer of this round"),
        (UnmaskRequest(good.survivors, (), good.shares_for_you), "peer",
         "unmask request: 'd04' is neither a survivor nor dropped"),
        (UnmaskRequest(good.survivors[1:], ("d00", "d04"), good.shares_for_you), "peer",
         "unmask request: 'd00' is not among the survivors"),
        (UnmaskRequest(("d00", "d01"), ("d02", "d03", "d04"), good.shares_for_you), "threshold",
         "unmask request: 2 survivors, fewer than the threshold 3"),
        (UnmaskRequest(good.survivors, good.dropped, {k: v for k, v in good.shares_for_you.items() if k != "d03"}),
         "share", "unmask request: no share from the survivor 'd03'"),
        (UnmaskRequest(good.survivors, good.dropped, swapped), "tag",
         "unmask request: the share from 'd01' does not open (another key, round or addressee, or altered)"),
        (UnmaskRequest(good.survivors, good.dropped, flipped), "tag",
         "unmask request: the share from 'd02' does not open (another key, round or addressee, or altered)"),
    ]
    for request, reason, message in cases:
        with pytest.raises(SecureError, match=f"^{re.escape(message)}$") as raised:
            devices["d00"].reveal(request)
        check(raised, reason)
    with pytest.raises(SecureError, match="^unmask request: 'd04' sent no masked update this round, so it cannot "
                                          "be a survivor$") as raised:
        devices["d04"].reveal(UnmaskRequest(params.ids, (), good.shares_for_you))
    check(raised, "order")
    answer = devices["d00"].reveal(good)  # none of the refusals counted as an answer
    assert set(answer.b_shares) == set(alive) and set(answer.pair_seeds) == {"d04"}
    assert devices["d00"].reveal(good) is answer


def test_a_device_of_another_round_or_with_another_key_is_refused():
    params = make_params(3)
    with pytest.raises(SecureError, match="^the round lists another public key for 'd00'$") as raised:
        DeviceSecureRound(KEYS["d01"], "d00", params)
    check(raised, "key")
    with pytest.raises(SecureError, match="^'d07' is not a peer of this round$"):
        DeviceSecureRound(KEYS["d07"], "d07", params)
    # a share sealed for another round does not open
    other = make_params(3, ctx=round_context("run-1", 8, "cluster-0"))
    old, new = make_devices(params, 11), make_devices(other, 11)
    q = updates(params, 11)
    shares = {d: old[d].mask(q[d]).shares["d00"] for d in params.ids}
    new["d00"].mask(q["d00"])
    with pytest.raises(SecureError, match="^unmask request: the share from 'd00' does not open") as raised:
        new["d00"].reveal(UnmaskRequest(params.ids, (), shares))
    check(raised, "tag")


# --- the wire format ----------------------------------------------------------------------------------

def wire_round():
    params = make_params(3, m=12, length=5)  # 5 entries of 12 bits: 8 bytes, 4 unused bits
    devices, q = make_devices(params, 12), updates(params, 12)
    server = ServerSecureRound(params)
    masked = {d: devices[d].mask(q[d]) for d in params.ids}
    for d in params.ids[:2]:
        server.add_masked(masked[d])
    request = server.close()["d00"]
    return params, masked["d00"], request, devices["d00"].reveal(request)


def refused(cls, data, params, reason, message):
    with pytest.raises(SecureError, match=f"^{re.escape(message)}$") as raised:
        cls.from_bytes(data, params)
    check(raised, reason)


def test_every_message_survives_its_bytes_and_every_prefix_or_extra_byte_is_refused():
    params, masked, request, reveal = wire_round()
    for msg in (masked, request, reveal):
        data = msg.to_bytes()
        assert len(data) == msg.wire_size and type(msg).from_bytes(data, params) == msg
        for cut in range(len(data)):
            with pytest.raises(SecureError) as raised:
                type(msg).from_bytes(data[:cut], params)
            check(raised, "length")
    data = masked.to_bytes()
    refused(MaskedUpdate, data + b"\x00", params, "length", f"masked update: 1 trailing bytes after byte {len(data)}")
    refused(MaskedUpdate, data[:10], params, "length",
            "masked update: truncated: y needs 8 bytes at byte 9, 1 left")
    refused(MaskedUpdate, b"", params, "length",
            "masked update: truncated: the kind byte needs 1 bytes at byte 0, 0 left")
    refused(Reveal, reveal.to_bytes() + b"xy", params, "length",
            f"reveal: 2 trailing bytes after byte {reveal.wire_size}")
    refused(UnmaskRequest, request.to_bytes()[:4], params, "length",
            "unmask request: truncated: an id of the survivors needs 3 bytes at byte 4, 0 left")
    refused(MaskedUpdate, request.to_bytes(), params, "kind", "masked update: kind byte 2, expected 1")
    refused(UnmaskRequest, request.to_bytes() + b"\x00", params, "length",
            f"unmask request: 1 trailing bytes after byte {request.wire_size}")
    refused(Reveal, masked.to_bytes(), params, "kind", "reveal: kind byte 1, expected 3")


def masked_bytes(sender=b"d00", y_size=8, y=None, shares=None, share_size=94):
    """A masked update's bytes, field by field."""
    y = bytes(y_size) if y is None else y
    shares = [b"d00", b"d01", b"d02"] if shares is None else shares
    body = b"".join(bytes([len(d)]) + d + bytes([share_size]) + bytes(share_size) for d in shares)
    return (b"\x01" + bytes([len(sender)]) + sender + struct.pack(">I", y_size) + y
            + struct.pack(">H", len(shares)) + body)


def test_hostile_masked_updates_are_refused_with_exact_messages():
    params = wire_round()[0]
    MaskedUpdate.from_bytes(masked_bytes(), params)  # well formed (the shares would fail to open later)
    cases = [
        (masked_bytes(y_size=7, y=bytes(7)), "length",
         "masked update: y holds 7 bytes, expected 8 for 5 entries of 12 bits"),
        (masked_bytes(y_size=9), "length", "masked update: y holds 9 bytes, expected 8 for 5 entries of 12 bits"),
        (masked_bytes(y=bytes(7) + b"\x10"), "padding",
         "masked update: the 4 unused bits of y's last byte are not zero"),
        (masked_bytes(share_size=93), "length",
         "masked update: the share for 'd00' holds 93 bytes, expected 94 (nonce 12, share 66, tag 16)"),
        (masked_bytes(share_size=95), "length",
         "masked update: the share for 'd00' holds 95 bytes, expected 94 (nonce 12, share 66, tag 16)"),
        (masked_bytes(sender=b"zz"), "peer", "masked update: 'zz' is not a peer of this round"),
        (masked_bytes(sender=b""), "peer", "masked update: the sender is an empty id"),
        (masked_bytes(sender=b"\xff"), "peer", "masked update: the sender is not UTF-8"),
        (masked_bytes(shares=[b"d00", b"d01", b"d01"]), "peer", "masked update: 'd01' appears twice in the shares"),
        (masked_bytes(shares=[b"d00", b"d01", b"d09"]), "peer", "masked update: 'd09' is not a peer of this round"),
        (masked_bytes(shares=[b"d00", b"d02"]), "peer", "masked update: no share for 'd01'"),
    ]
    for data, reason, message in cases:
        refused(MaskedUpdate, data, params, reason, message)


def test_hostile_requests_and_reveals_are_refused_with_exact_messages():
    params, _, request, reveal = wire_round()
    ids = b"\x00\x02\x03d00\x03d01"
    refused(UnmaskRequest, b"\x02\x00\x02\x03d00\x03d00\x00\x00\x00\x00", params, "peer",
            "unmask request: 'd00' appears twice in the survivors")
    refused(UnmaskRequest, b"\x02" + ids + b"\x00\x01\x03d07\x00\x00", params, "peer",
            "unmask request: 'd07' is not a peer of this round")
    refused(UnmaskRequest, b"\x02" + ids + b"\x00\x01\x03d02\x00\x01\x03d00\x0c" + bytes(12), params, "length",
            "unmask request: the share for 'd00' holds 12 bytes, expected 94 (nonce 12, share 66, tag 16)")
    share, seed = reveal.b_shares["d00"], reveal.pair_seeds["d02"]
    head = b"\x03\x03d00\x00\x01\x03d00"
    refused(Reveal, head + b"\xff" * 66 + b"\x00\x00", params, "range",
            "reveal: the share of 'd00': a share is not below the prime 2**521 - 1")
    refused(Reveal, head + share + b"\x00\x01\x03d00" + seed, params, "both",
            "reveal: both a share and a pair seed of 'd00'")
    refused(Reveal, head + share + b"\x00\x02\x03d02" + seed + b"\x03d02" + seed, params, "peer",
            "reveal: 'd02' appears twice in the pair seeds")
    refused(Reveal, head + share + b"\x00\x01\x03d02" + seed[:31], params, "length",
            "reveal: truncated: the pair seed of 'd02' needs 32 bytes at byte 83, 31 left")
    with pytest.raises(SecureError, match=r"^reveal: the pair seed with 'd02' is not 32 bytes$"):
        Reveal("d00", {"d00": share}, {"d02": seed[:31]}).check(params)


def test_random_corruptions_raise_only_secure_errors():
    params, masked, request, reveal = wire_round()
    rng = np.random.default_rng(13)
    for msg in (masked, request, reveal):
        data = bytearray(msg.to_bytes())
        for _ in range(300):
            bad = bytearray(data)
            for i in rng.integers(0, len(bad), rng.integers(1, 4)):
                bad[i] = rng.integers(0, 256)
            try:
                type(msg).from_bytes(bytes(bad), params)
            except SecureError:
                pass


# --- the quantiser ------------------------------------------------------------------------------------

def test_modulus_bits_hold_the_sum_of_every_device():
    assert modulus_bits_for(8, 1) == 8 and modulus_bits_for(8, 2) == 9 and modulus_bits_for(8, 13) == 12
    assert modulus_bits_for(4, 2) == 8 and modulus_bits_for(16, 65536) == 32
    with pytest.raises(ValueError, match="more than 32"):
        modulus_bits_for(16, 65537)


def test_the_quantiser_is_close_unbiased_and_clips_exactly():
    rng = np.random.default_rng(14)
    x = rng.standard_normal(10_000).astype(np.float32)
    quant = SecureQuantizer(clip=float(np.linalg.norm(x)) * 1.01, bits=8, seed_rotation=b"round 7")
    q, clipped = quant.encode(x, rng)
    assert not clipped and q.dtype == np.int64 and q.shape == (10_000,)
    assert q.min() >= -128 and q.max() <= 127
    back = quant.decode(q, 1, 10_000)
    one = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert back.dtype == np.float32 and one < 0.1
    mean = np.mean([quant.decode(quant.encode(x, rng)[0], 1, 10_000) for _ in range(200)], axis=0)
    assert np.linalg.norm(mean - x) / np.linalg.norm(x) < 2.5 * one / np.sqrt(200)
    # a long vector: scaled to norm clip exactly, and the quantiser unbiased around the scaled vector
    small = SecureQuantizer(clip=1.0, bits=8, seed_rotation=b"round 7")
    scaled, was = small.clip_vector(x)
    assert was and abs(np.linalg.norm(scaled) - 1.0) < 1e-12 and np.allclose(scaled * np.linalg.norm(x), x, rtol=1e-6)
    assert small.encode(x, rng)[1] and not small.encode(scaled * 0.999, rng)[1]
    total = sum(small.encode(x, rng)[0] for _ in range(200))
    assert np.linalg.norm(small.decode(total, 200, 10_000) - scaled) < 0.02


def test_quantised_updates_of_a_secure_round_decode_to_their_mean():
    params_n, length = 5, 1000
    quant = SecureQuantizer(clip=10.0, bits=8, seed_rotation=b"round 3")
    m = modulus_bits_for(8, params_n)
    params = make_params(params_n, m=m, length=quant.length(length))
    rng = np.random.default_rng(15)
    xs = {d: rng.standard_normal(length).astype(np.float32) * 0.2 for d in params.ids}
    q = {d: quant.encode(xs[d], rng)[0] for d in params.ids}
    server = run_round(params, make_devices(params, 15), q, params.ids, params.ids)
    total = server.unmask()
    assert np.array_equal(total, sum(q.values()))
    mean = quant.decode(total, params_n, length)
    truth = np.mean(list(xs.values()), axis=0)
    assert np.linalg.norm(mean - truth) / np.linalg.norm(truth) < 0.1
