"""P/D between KV cache dtypes on the loopback transport: equal dtypes move the cache as stored
(bit for bit, fp8's scales included, in fewer bytes), float32 and bfloat16 convert on arrival, and
a pair with no converter is refused at the handshake naming both dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import BLOCK_SIZE, expected_kv
from pdserve.kv_transfer.transfer_state import TransferState

TOKENS = 4 * BLOCK_SIZE + 2


def transfer(world, producer: str, consumer: str, tp: tuple[int, int] = (1, 1)):
    p = world.instance("P", tp[0], kv_cache_dtype=producer)
    d = world.instance("D", tp[1], kv_cache_dtype=consumer)
    d.receive("r1", p.prefill("p1", TOKENS, seed=3))
    blocks = d.admit("r1", TOKENS)
    world.run()
    return p, d, blocks


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name, bytes_per_slot", [("float32", 4 * 2), ("bfloat16", 2 * 2), ("float16", 2 * 2),
                                                  ("fp8_e4m3", 1 * 2 + 4)])
def test_equal_dtypes_move_the_cache_as_stored(world, name, bytes_per_slot):
    p, d, blocks = transfer(world, name, name, tp=(1, 2))
    assert d.outcome("r1").state == TransferState.KV_LOADED
    num_read = -(-TOKENS // BLOCK_SIZE)
    theirs, their_blocks = p.kv_caches[0], p.filled["p1"][:num_read]
    for kv, heads in zip(d.kv_caches, d.local_heads):  # each consumer rank holds its heads, bit for bit
        mine = [kv.buffer[:, :, blocks[:num_read]]] + ([] if kv.scales is None else [kv.scales[:, :, blocks[:num_read]]])
        want = [theirs.buffer[:, :, their_blocks, heads.start:heads.stop]]
        if theirs.scales is not None:
            want.append(theirs.scales[:, :, their_blocks, heads.start:heads.stop])
        assert [as_bytes(t) for t in mine] == [as_bytes(t) for t in want]
    # 2 layers x K/V x 4 heads x the slots of the blocks read, each 2 dims (+ an fp8 scale)
    assert world.fabric.num_bytes_read == 2 * 2 * 4 * num_read * BLOCK_SIZE * bytes_per_slot


@pytest.mark.parametrize("producer, consumer", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_float_dtypes_convert_on_arrival(world, producer, consumer):
    p, d, blocks = transfer(world, producer, consumer, tp=(2, 1))
    assert d.outcome("r1").state == TransferState.KV_LOADED
    got = d.kv("r1", TOKENS)
    want = expected_kv(3, 4, TOKENS)
    # the pattern rounded to the coarser of the two dtypes, never reinterpreted bits
    np.testing.assert_allclose(got, want, rtol=2 ** -8)
    assert not np.array_equal(got, want)
    assert world.fabric.agents["D/rank0"].regions == [(d.kv_caches[0].base_address,
                                                       d.kv_caches[0].layout.total_bytes)]  # staging freed


@pytest.mark.parametrize("producer, consumer", [("fp8_e4m3", "bfloat16"), ("float32", "fp8_e4m3")])
def test_a_pair_without_a_converter_is_refused_naming_both_dtypes(world, producer, consumer):
    p, d, _ = transfer(world, producer, consumer)
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED
    assert f"the producer stores {producer}, this instance {consumer}" in o.message, o.message
    assert world.fabric.num_bytes_read == 0
