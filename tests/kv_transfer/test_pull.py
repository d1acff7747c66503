"""A producer pulling a prompt's blocks from a holder (a decode instance that cached the
conversation's earlier turns) on the loopback transport: it gets the leading run the holder caches,
by content hash, reads exactly those bytes, and the holder's blocks come back; anything short of
that (nothing held, an unreachable holder, a failed READ, a holder too busy to answer) ends in
RECOMPUTE, never in a failed request or a pinned block."""

from __future__ import annotations

import numpy as np
import pytest

from harness import BLOCK_SIZE, expected_kv
from pdserve.engine.request import Request
from pdserve.kv_transfer.outcomes import RemotePull
from pdserve.kv_transfer.params import Holder
from pdserve.kv_transfer.transfer_state import TransferState
from pdserve.kv_transfer.producer import CLAIM_WAIT_S
from pdserve.prefix_cache.hashing import extra_keys, hash_blocks
from pdserve.sampling_params import InvalidRequestError, SamplingParams

HISTORY = list(range(200, 216))  # four full blocks a decode instance generated or read


def holder_with(world, name: str, tokens: list[int], seed: int, tp: int = 1):
    """An instance whose prefix cache holds `tokens`' full blocks (filled with `seed`'s pattern)."""
    d = world.instance(name, tp, prefix_caching=True)
    blocks = d.pool.allocate(len(tokens) // BLOCK_SIZE)
    d.fill(blocks, seed)
    r = Request("history", tokens + [1], SamplingParams(), (), 8)
    r.block_ids, r.num_computed_tokens = blocks, len(tokens)
    d.pool.cache_full_blocks(r)
    d.pool.release(blocks)  # free again, still cached
    return d


def digests(tokens: list[int]) -> list[bytes]:
    return hash_blocks(tokens, BLOCK_SIZE, extra_keys("m"))


def pull(world, p, holders, tokens=HISTORY, rid="r1", spare=False) -> list[int]:
    blocks = p.pool.allocate(len(tokens) // BLOCK_SIZE)
    p.blocks[rid] = blocks
    spec = RemotePull(rid, blocks, digests(tokens),
                      tuple(Holder.parse({**h.connector.holder(), "spare": spare}, "h") for h in holders))
    p.step(pulls=[spec])  # the step whose scheduler admitted the pull
    return blocks


def assert_holder_idle(d):
    assert d.pool.num_free_blocks == d.pool.num_blocks and not d.connector.producer.has_leases


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2)])
def test_a_producer_reads_the_blocks_a_holder_caches(world, p_tp, d_tp):
    d = holder_with(world, "D", HISTORY, seed=9, tp=d_tp)
    p = world.instance("P", p_tp)
    pull(world, p, [d])
    world.run(8)
    o = p.outcome("r1")
    assert o.state == TransferState.KV_LOADED and o.num_blocks == 4
    np.testing.assert_array_equal(p.kv("r1", 16), expected_kv(9, 4, 16))
    assert p.connector.consumer.counter_values()["kv_blocks_pulled"] == 4
    world.run(2)
    assert_holder_idle(d)  # every read notified: the claim's lease ended, the blocks stay cached
    assert d.connector.producer.counters()["kv_blocks_claimed"] == 4
    assert len(d.pool.held_run(digests(HISTORY))) == 4


@pytest.mark.parametrize("spare", [False, True])
def test_a_holder_told_its_copy_is_spare_now_reuses_what_it_lent_first(world, spare):
    """The proxy's `spare` on a holder (another instance keeps the prompt now: a history moved):
    the blocks it lent go to its spare list when the claim's lease ends; without it they stay kept."""
    d = holder_with(world, "D", HISTORY, seed=9)
    lent = d.pool.held_run(digests(HISTORY))
    d.pool.mark(lent, spare=False)  # the history's own request kept it
    pull(world, world.instance("P"), [d], spare=spare)
    world.run(10)
    assert_holder_idle(d)
    assert len(d.pool.held_run(digests(HISTORY))) == 4  # still cached either way
    assert (set(lent) <= set(d.pool.spare)) is spare and (set(lent) <= set(d.pool.free)) is not spare


def test_only_the_leading_run_the_holder_caches_is_read(world):
    d = holder_with(world, "D", HISTORY[:8], seed=9)  # two of the four blocks
    p = world.instance("P")
    pull(world, p, [d])
    world.run(8)
    o = p.outcome("r1")
    assert o.state == TransferState.KV_LOADED and o.num_blocks == 2
    np.testing.assert_array_equal(p.kv("r1", 8), expected_kv(9, 4, 8))


def test_a_holder_with_nothing_means_computing_it(world):
    d = holder_with(world, "D", [1, 2, 3, 4], seed=9)  # another history
    p = world.instance("P")
    pull(world, p, [d])
    world.run(4)
    assert p.outcome("r1").state == TransferState.RECOMPUTING
    assert_holder_idle(d)


def test_the_next_holder_is_asked_when_the_first_has_nothing_or_is_gone(world):
    empty = holder_with(world, "E", [1, 2, 3, 4], seed=1)
    full = holder_with(world, "D", HISTORY, seed=9)
    gone = holder_with(world, "G", HISTORY, seed=9)
    gone.connector.producer.server.close()  # its side channel answers nothing
    p = world.instance("P")
    pull(world, p, [gone, empty, full])
    world.run(16, advance_s=0.5)  # each holder answers within the claim wait (pin, then grant, a step later)
    o = p.outcome("r1")
    assert o.state == TransferState.KV_LOADED and o.num_blocks == 4


def test_a_failed_pull_is_computed_never_failed_and_frees_the_holder(world):
    d = holder_with(world, "D", HISTORY, seed=9)
    p = world.instance("P", failure_policy="fail")
    world.fabric.fail_reads = True
    pull(world, p, [d])
    world.run(8)
    assert p.outcome("r1").state == TransferState.RECOMPUTING
    world.run(2)
    assert_holder_idle(d)


def test_a_holder_too_busy_to_answer_in_time_pins_nothing(world):
    d = holder_with(world, "D", HISTORY, seed=9)
    p = world.instance("P")
    pull(world, p, [d])
    world.network.pump()  # the claim reaches D; D's engine does not step for a while
    world.clock.advance(CLAIM_WAIT_S + 0.1)
    world.network.pump()  # "nothing held" goes back
    p.step()
    assert p.outcome("r1").state == TransferState.RECOMPUTING
    world.run(4)  # D's engine grants late: the grant nobody took is released at once
    assert_holder_idle(d)


def test_a_holder_in_a_long_step_grants_at_its_next_step_within_the_claimers_wait(world):
    """A holder pins between its steps, and a step may take seconds on a loaded CPU instance: the
    claim waits as long as its claimer does (not 1 s), and the pin and the grant come in one step."""
    d = holder_with(world, "D", HISTORY, seed=9)
    p = world.instance("P")
    pull(world, p, [d])
    world.network.pump()  # the claim reaches D, whose engine is in the middle of a long step
    world.clock.advance(5.0)
    d.step()  # its next step pins the blocks and answers
    world.network.pump()  # the grant reaches P
    assert d.connector.producer.counters()["kv_blocks_claimed"] == 4
    world.run(8)
    o = p.outcome("r1")
    assert o.state == TransferState.KV_LOADED and o.num_blocks == 4
    np.testing.assert_array_equal(p.kv("r1", 16), expected_kv(9, 4, 16))


def test_holders_must_be_signed_by_the_deployment(world):
    secret = {"secret": b"k" * 32}
    d = world.instance("D", **secret)
    p = world.instance("P", **secret)
    token = d.connector.holder()
    p.connector.consumer.check_holders((Holder.parse(token, "h"),))  # signed: accepted
    # the proxy's word on a holder's copy is not signed
    p.connector.consumer.check_holders((Holder.parse({**token, "spare": True}, "h"),))
    with pytest.raises(InvalidRequestError, match=r"h\.spare"):
        Holder.parse({**token, "spare": "yes"}, "h")
    forged = Holder.parse({**token, "port": token["port"] + 1}, "h")
    with pytest.raises(InvalidRequestError, match=r"kv_holders\[0\].signature"):
        p.connector.consumer.check_holders((forged,))
