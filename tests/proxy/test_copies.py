"""Which copy of a disaggregated prompt's KV is kept (proxy/copies.py): a conversation stays in one
pool turn after turn; new conversations alternate between the pools; a local prefill keeps decode's."""

from __future__ import annotations

from pdserve.proxy.copies import DECODE, PREFILL, Copies


def test_new_conversations_alternate_and_each_keeps_its_pool_turn_after_turn():
    copies = Copies()
    a, b = [11, 12], [21, 22]
    first_a, first_b = copies.spare(a, local=False), copies.spare(b, local=False)
    assert {first_a, first_b} == {PREFILL, DECODE}
    for turn in range(3):  # each turn extends the last by a few blocks
        a, b = a + [100 + turn, 110 + turn], b + [200 + turn]
        assert copies.spare(a, local=False) == first_a
        assert copies.spare(b, local=False) == first_b


def test_a_local_prefill_keeps_decode_and_the_conversation_stays_there():
    copies = Copies()
    history = [1, 2, 3]
    spare = copies.spare(history, local=False)
    if spare == DECODE:  # make the producer the keeper first, so the switch shows
        pass
    else:
        history = [4, 5, 6]
        assert copies.spare(history, local=False) == DECODE
    assert copies.spare(history + [7], local=True) is None  # one copy, on decode
    assert copies.spare(history + [7, 8], local=False) == PREFILL  # decode keeps it from now on


def test_prompts_without_a_full_block_are_not_remembered_and_memory_is_bounded():
    copies = Copies(max_prompts=3)
    assert copies.spare([], local=False) is None and not copies.keeper
    for i in range(10):
        copies.spare([i], local=False)
    assert list(copies.keeper) == [7, 8, 9]
