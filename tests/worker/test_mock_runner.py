"""The mock model: it writes each token's id into its KV slots, waits as the timing model says, and
picks the next token from the context it reads back from the cache, so wrong KV gives a wrong answer."""

from __future__ import annotations

import torch

from pdserve.worker.kv_cache import CacheLayout, KVCache
from pdserve.worker.messages import ScheduledChunk
from pdserve.worker.mock_runner import MockRunner, TimingModel, next_token

VOCAB = 1000


def runner(sleeps: list[float], num_blocks: int = 8) -> MockRunner:
    layout = CacheLayout(num_layers=2, num_blocks=num_blocks, num_kv_heads=2, block_size=4, head_dim=2,
                         dtype_bytes=4)
    return MockRunner(KVCache(layout, torch.float32), VOCAB, TimingModel(), speedup=2.0, sleep=sleeps.append)


def test_greedy_tokens_follow_the_context_written_in_the_cache():
    sleeps = []
    r = runner(sleeps)
    prompt = list(range(100, 110))
    logits, ids, _ = r.execute([ScheduledChunk("a", prompt, 0, [0, 1, 2], True)])
    assert ids == ["a"] and int(logits.argmax()) == next_token(prompt, VOCAB)
    assert r.kv_cache.buffer[1, 1, 2, 1, 1, 0] == 109  # position 9: block 2, slot 1, in every layer and head
    first = int(logits.argmax())
    logits, _, _ = r.execute([ScheduledChunk("a", [first], 10, [0, 1, 2], True)])  # a decode step
    assert int(logits.argmax()) == next_token(prompt + [first], VOCAB)
    r.kv_cache.buffer[:, :, 0, :, 0, :] += 1  # the first token's KV goes wrong: so does the answer
    logits, _, _ = r.execute([ScheduledChunk("a", [5], 11, [0, 1, 2], True)])
    assert int(logits.argmax()) != next_token(prompt + [first, 5], VOCAB)


def test_a_step_takes_the_timing_models_time_scaled():
    sleeps = []
    r = runner(sleeps)
    r.execute([ScheduledChunk("a", list(range(10, 30)), 0, [0, 1, 2, 3, 4], False),
               ScheduledChunk("b", [7], 12, [5, 6, 7, 7], True)])
    expected = TimingModel().step_time(20, 1, 13) / 2.0
    assert 0 <= expected - sleeps[0] < 0.002  # minus the time the step itself took
