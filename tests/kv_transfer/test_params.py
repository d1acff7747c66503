"""kv_transfer_params parsing: typed once at the edge; every error names its field."""

from __future__ import annotations

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
