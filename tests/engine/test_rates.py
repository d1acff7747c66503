"""Step rates: prefill tokens per second from steps that prefilled enough to time, the decode step
time from steps that only decoded, each smoothed."""

from __future__ import annotations

import pytest

from pdserve.engine.rates import StepRates


def test_prefill_and_decode_steps_each_feed_their_own_rate():
    r = StepRates()
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (0.0, 0.0)  # not measured yet
    r.observe(prompt_tokens=512, num_running=1, duration_s=0.5)
    assert r.prefill_tokens_per_s == 1024.0 and r.decode_step_s == 0.0
    r.observe(prompt_tokens=0, num_running=4, duration_s=0.02)
    assert r.decode_step_s == 0.02
    r.observe(prompt_tokens=4, num_running=4, duration_s=0.03)  # too few tokens to time: neither
    assert r.prefill_tokens_per_s == 1024.0 and r.decode_step_s == 0.02
    r.observe(prompt_tokens=256, num_running=1, duration_s=0.5)
    assert r.prefill_tokens_per_s == pytest.approx(0.8 * 1024 + 0.2 * 512)
    r.observe(prompt_tokens=0, num_running=0, duration_s=0.001)  # an idle turn is no decode step
    assert r.decode_step_s == 0.02
