"""A consumer load's lifecycle (the one P/D enum, shared with the engine's request) and the rule that
params are used once."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.load import Claims, Load
from pdserve.kv_transfer.outcomes import LoadOutcome
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.kv_transfer.transfer_state import TransferState as S
from pdserve.sampling_params import InvalidRequestError


def params(rid: str) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, remote_engine_id="P", remote_request_id=rid)


def test_transitions_follow_the_table():
    load = Load("r", params("a"))
    assert load.state == S.AWAITING_KV
    for state in (S.WAITING_PEER, S.READY, S.READING, S.ABORTING, S.ABORTED):
        load.move_to(state)
    with pytest.raises(AssertionError):
        Load("r", params("a")).move_to(S.READING)  # never READ before the peer is ready
    reading = Load("r", params("a"))
    for state in (S.WAITING_PEER, S.READY, S.READING):
        reading.move_to(state)
    with pytest.raises(AssertionError):
        reading.move_to(S.ABORTED)  # only through ABORTING: every rank reports first
    with pytest.raises(AssertionError):
        Load("r", params("a")).move_to(S.HANDED_OFF)  # a producer's state


def test_an_outcome_carries_how_a_load_ended():
    assert LoadOutcome("r", S.KV_LOADED).state.is_final
    with pytest.raises(AssertionError):
        LoadOutcome("r", S.READING)


def test_params_are_claimed_once_and_old_claims_are_forgotten():
    claims = Claims(kept=2)
    claims.claim(params("a"))
    with pytest.raises(InvalidRequestError) as e:
        claims.claim(params("a"))
    assert e.value.field == "kv_transfer_params.remote_request_id"
    claims.claim(params("b"))
    claims.claim(params("c"))
    claims.claim(params("a"))  # long forgotten (its lease is gone too)
