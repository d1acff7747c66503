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
