"""The P/D fingerprint covers the weights' format: a producer and a consumer of one checkpoint whose
weights are quantized differently are refused at the handshake, naming both formats."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.handshake import HandshakeError, Peer, accept_reply, answer_handshake
from pdserve.kv_transfer.messages import HANDSHAKE_VERSION, HandshakeRequest, RankAgent


def test_a_pair_with_different_weight_formats_is_refused(make_llm, tiny_model):
    plain = make_llm(tiny_model, num_blocks=16).engine
    int8 = make_llm(tiny_model, num_blocks=16, quantization="int8").engine
    again = make_llm(tiny_model, num_blocks=16, quantization="int8").engine
    assert int8.fingerprint() == again.fingerprint()
    assert plain.fingerprint().dtype == int8.fingerprint().dtype  # only the weights differ
    reply = answer_handshake(HandshakeRequest(HANDSHAKE_VERSION, "P", [0]), "P", int8.fingerprint(),
                             [RankAgent(0, "P/rank0", b"meta", [0, 1], 8, 2, 64, 16)])
    with pytest.raises(HandshakeError) as e:
        accept_reply(reply, Peer("P", "h", 1, 1, [0]), plain.fingerprint(), 5)
    assert "weights=none" in str(e.value) and "weights=int8" in str(e.value)
    assert plain.model_key() != int8.model_key()  # nor do their prefix-cache blocks match
