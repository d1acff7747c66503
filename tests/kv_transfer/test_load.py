"""A consumer load's lifecycle and the rule that params are used once."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.load import Claims, Load, LoadState
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.sampling_params import InvalidRequestError


def params(rid: str) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, remote_engine_id="P", remote_request_id=rid)


def test_transitions_follow_the_table():
    load = Load("r", params("a"))
    for state in (LoadState.WAITING_PEER, LoadState.READY, LoadState.READING, LoadState.ABORTING):
        load.move_to(state)
    with pytest.raises(AssertionError):
        Load("r", params("a")).move_to(LoadState.READING)  # never READ before the peer is ready


def test_params_are_claimed_once_and_old_claims_are_forgotten():
    claims = Claims(kept=2)
    claims.claim(params("a"))
    with pytest.raises(InvalidRequestError) as e:
        claims.claim(params("a"))
    assert e.value.field == "kv_transfer_params.remote_request_id"
    claims.claim(params("b"))
    claims.claim(params("c"))
    claims.claim(params("a"))  # long forgotten (its lease is gone too)
