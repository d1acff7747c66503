"""Conditional disaggregation's decision, as pure logic."""

from __future__ import annotations

from pdserve.proxy.decision import LOCAL, REMOTE, DisaggPolicy, prompt_tokens


def test_off_means_always_remote():
    assert DisaggPolicy().decide(10, 0, 100) == REMOTE


def test_short_prompts_prefill_on_an_idle_decode_long_ones_on_producers():
    p = DisaggPolicy(local_max_tokens=256, decode_queue_max=2)
    assert p.decide(100, decode_queued=0, prefill_queued=0) == LOCAL
    assert p.decide(100, decode_queued=3, prefill_queued=0) == REMOTE  # decode is busy enough
    assert p.decide(1000, decode_queued=0, prefill_queued=0) == REMOTE
    assert p.decide(1000, decode_queued=0, prefill_queued=20) == LOCAL  # producers swamped, decode idle
    assert p.decide(5000, decode_queued=0, prefill_queued=20) == REMOTE  # but never a huge prompt
    assert p.decide(None, 0, 0) == REMOTE


def test_prompt_length_estimates():
    assert prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert prompt_tokens({"prompt": "x" * 400}) == 101
    assert prompt_tokens({"messages": [{"role": "user", "content": "y" * 40}]}) == 18
    assert prompt_tokens({"prompt": ["a", "b"]}) is None
