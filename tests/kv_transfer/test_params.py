"""kv_transfer_params parsing: typed once at the edge; every error names its field."""

from __future__ import annotations

import math

import pytest

from pdserve.kv_transfer.params import KVTransferParams, prompt_hash
from pdserve.sampling_params import InvalidRequestError

GOOD = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
        "remote_port": 5555, "remote_block_ids": [3, 4], "remote_request_id": "r", "tp_size": 2,
        "first_token_id": 9, "prompt_hash": prompt_hash(list(range(20))), "lease_s": 30}


def test_vllm_proxy_shape_with_nulls_is_a_producer_request():
    p = KVTransferParams.parse({"do_remote_decode": True, "do_remote_prefill": False,
                                "remote_engine_id": None, "remote_block_ids": None,
                                "remote_host": None, "remote_port": None})
    assert p.do_remote_decode and not p.do_remote_prefill and p.remote_block_ids is None


def test_round_trip_and_checks():
    p = KVTransferParams.parse(GOOD)
    assert KVTransferParams.parse(p.to_json()) == p
    p.check_against(list(range(20)), 16, 1, 4, 2, 100)
    with pytest.raises(InvalidRequestError) as e:
        p.check_against(list(range(21)), 16, 1, 4, 2, 100)
    assert e.value.field == "kv_transfer_params.prompt_hash"
    with pytest.raises(InvalidRequestError) as e:
        p.check_against(list(range(40)), 16, 1, 4, 2, 100)
    assert e.value.field == "kv_transfer_params.remote_block_ids"


@pytest.mark.parametrize("key, value", [
    ("remote_block_ids", [1, True]), ("remote_block_ids", []), ("remote_block_ids", [-3]),
    ("tp_size", 0), ("tp_size", 1.5), ("remote_port", "80"), ("remote_host", ""),
    ("first_token_id", -1), ("do_remote_prefill", 1), ("lease_s", "long"),
])
def test_each_bad_field_is_named(key, value):
    with pytest.raises(InvalidRequestError) as e:
        KVTransferParams.parse({**GOOD, key: value})
    assert e.value.field == f"kv_transfer_params.{key}"


def test_not_an_object():
    with pytest.raises(InvalidRequestError) as e:
        KVTransferParams.parse([1, 2])
    assert e.value.field == "kv_transfer_params"


# --- signed params: canonical numbers, clock skew, a secret rotated without a restart ---------------

def signed(secret: bytes, lease_s: float = 30.0, expires_at: float = 2000.0) -> dict:
    import dataclasses

    from pdserve.kv_transfer.signing import sign
    p = dataclasses.replace(KVTransferParams.parse(GOOD), lease_s=lease_s, expires_at=expires_at)
    return dataclasses.replace(p, signature=sign(p, secret)).to_json()


def check(params: dict, secret: bytes | None, now: float = 1000.0, **kw) -> None:
    from pdserve.kv_transfer.signing import verify
    verify(KVTransferParams.parse(params), secret, now, **kw)


def test_a_number_signs_the_same_whether_int_or_float():
    check(signed(b"s", lease_s=30), b"s")  # the Python API's lease_s=30 arrives as 30.0
    check(signed(b"s", expires_at=2000), b"s")
    assert signed(b"s", lease_s=30)["signature"] == signed(b"s", lease_s=30.0)["signature"]


def test_expiry_allows_bounded_clock_skew_and_says_by_how_much():
    params = signed(b"s", expires_at=1000.0)
    check(params, b"s", now=1003.0, skew_s=5.0)  # the producer's clock is 3 s behind this host's
    with pytest.raises(InvalidRequestError) as e:
        check(params, b"s", now=1012.5, skew_s=5.0)
    assert e.value.field == "kv_transfer_params.expires_at"
    assert "expired 12.5 s ago" in str(e.value) and "clock skew" in str(e.value), str(e.value)
    with pytest.raises(InvalidRequestError):
        check(params, b"s", now=1000.5)  # no allowance unless configured
    from pdserve.config import ConfigError, KVTransferConfig
    assert KVTransferConfig().clock_skew_s == 5.0
    with pytest.raises(ConfigError, match="kv_clock_skew_s"):  # bounded: a larger gap needs NTP, not this
        KVTransferConfig(clock_skew_s=3600.0)


def test_a_secret_rotates_without_restarting_every_instance():
    """Sign with the current secret, verify with the current or the previous one."""
    for signer, verifier, previous, ok in [
        (b"old", b"new", b"old", True),  # rolled verifier, producer not yet rolled
        (b"new", b"old", b"new", True),  # phase 1 of the roll: the new secret accepted, not yet used
        (b"new", b"new", b"old", True),
        (b"new", b"old", None, False),  # not rolled at all
        (b"other", b"new", b"old", False),
    ]:
        if ok:
            check(signed(signer), verifier, previous=previous)
        else:
            with pytest.raises(InvalidRequestError) as e:
                check(signed(signer), verifier, previous=previous)
            assert e.value.field == "kv_transfer_params.signature"
    from pdserve.config import ConfigError, KVTransferConfig
    with pytest.raises(ConfigError, match="previous_secret"):
        KVTransferConfig(previous_secret=b"old")


def test_notifications_verify_with_either_secret():
    from pdserve.kv_transfer.messages import Notification, NotificationKind
    from pdserve.kv_transfer.signing import notification_mac_ok, sign_notification
    note = sign_notification(Notification("r", "c", 0, 1, NotificationKind.DONE), b"old")
    assert notification_mac_ok(note, b"new", previous=b"old")
    assert not notification_mac_ok(note, b"new")
    assert not notification_mac_ok(sign_notification(note, b"other"), b"new", previous=b"old")


def test_a_transfer_between_instances_mid_rotation(world):
    """Phase 2 of the roll: the producer signs with the new secret, the consumer still with the old
    one; the params are accepted, the READ happens, and the consumer's notifications free the lease."""
    p = world.instance("P", 1, secret=b"new", previous_secret=b"old", lease_s=30)
    d = world.instance("D", 1, secret=b"old", previous_secret=b"new")
    d.receive("r1", p.prefill("p1", 10))
    d.admit("r1", 10)
    world.run()
    assert d.outcome("r1").state.name == "KV_LOADED"
    d.finish("r1")
    world.run(2)
    assert p.num_free == p.pool.num_blocks and not p.connector.producer.has_leases


# --- a router that re-encodes JSON numbers ------------------------------------------------------------

def reencoded(obj, number_format):
    """`obj` as a router that parses JSON and prints it again may pass it on: every float printed
    by `number_format` (other digits, or a value one ulp off, as a parser that is not exact reads it)."""
    import json
    return json.loads(json.dumps(obj), parse_float=lambda s: number_format(float(s)))


@pytest.mark.parametrize("number_format", [
    lambda x: float(f"{x:.15g}"),  # 15 significant digits
    lambda x: math.nextafter(x, 0.0) if x else x,  # a parser one ulp off (serde_json without float_roundtrip)
])
def test_signed_params_survive_any_json_round_trip(number_format):
    import dataclasses

    from pdserve.kv_transfer.params import FirstToken
    from pdserve.kv_transfer.signing import sign
    first = FirstToken(9, -3.9472532272338867, ((9, -3.9472532272338867), (4, -0.10000000000000014)))
    p = dataclasses.replace(KVTransferParams.parse(GOOD), first_token=first, lease_s=0.3,
                            expires_at=1796342400.123)
    wire = dataclasses.replace(p, signature=sign(p, b"s")).to_json()
    again = reencoded(wire, number_format)
    check(again, b"s", now=1796342400.0)
    assert KVTransferParams.parse(again).first_token == first  # the values too, to the bit
    assert KVTransferParams.parse(again).lease_s == 0.3 and KVTransferParams.parse(again).expires_at == 1796342400.123


def test_a_holder_survives_a_json_round_trip():
    import dataclasses

    from pdserve.kv_transfer.params import Holder
    from pdserve.kv_transfer.signing import sign, verify
    h = Holder("e", "127.0.0.1", 5555, 1, expires_at=1796342400.123)
    wire = dataclasses.replace(h, signature=sign(h, b"s")).to_json()
    again = Holder.parse(reencoded(wire, lambda x: math.nextafter(x, 0.0)), "kv_holders[0]")
    verify(again, b"s", now=1796342400.0)
    assert again.expires_at == 1796342400.123


def test_numbers_written_by_hand_are_still_read():
    """Params a person (or an older producer) wrote with plain JSON numbers parse as before."""
    p = KVTransferParams.parse({**GOOD, "first_token_logprob": -0.5, "first_token_top_logprobs": [[9, -0.5]],
                                "lease_s": 2.5})
    assert p.first_token.logprob == -0.5 and p.first_token.top_logprobs == ((9, -0.5),) and p.lease_s == 2.5
    for key, value in (("lease_s", "zz"), ("first_token_logprob", "7ff0000000000000"),  # not finite
                       ("lease_s", "bff0000000000000")):  # -1.0: out of range
        with pytest.raises(InvalidRequestError) as e:
            KVTransferParams.parse({**GOOD, key: value})
        assert e.value.field == f"kv_transfer_params.{key}"


def test_the_producers_cached_tokens_travel_signed_and_are_checked():
    """A consumer reports the prompt tokens its producer found cached (`usage.prompt_tokens_details`)."""
    import dataclasses

    from pdserve.kv_transfer.signing import sign
    p = dataclasses.replace(KVTransferParams.parse(GOOD), num_cached_tokens=16, expires_at=2000.0)
    wire = dataclasses.replace(p, signature=sign(p, b"s")).to_json()
    assert wire["num_cached_tokens"] == 16
    check(wire, b"s")
    with pytest.raises(InvalidRequestError) as e:
        check({**wire, "num_cached_tokens": 20}, b"s")
    assert e.value.field == "kv_transfer_params.signature"
    with pytest.raises(InvalidRequestError) as e:
        KVTransferParams.parse({**GOOD, "num_cached_tokens": 21}).check_against(list(range(20)), 16, 1, 4, 2, 100)
    assert e.value.field == "kv_transfer_params.num_cached_tokens"
