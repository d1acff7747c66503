"""Bad input is a clear error naming the problem; nothing leaks and the engine keeps serving."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.sampling_params import InvalidRequestError


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"logprobs": 50}, "logprobs"),
    ({"n": 0}, "n"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_bad_prompts_then_engine_still_serves(llm_tp1):
    engine = llm_tp1.engine
    idle = engine.pool.num_free_blocks
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        engine.add_request("bad-1", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="too long"):
        engine.add_request("bad-2", [5] * engine.max_model_len, SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("bad-3", [5, 10 ** 6], SamplingParams())
    assert engine.pool.num_free_blocks == idle
    assert not engine.has_unfinished_requests()
    out = llm_tp1.generate(["still serving"], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_abort_returns_every_block(llm_tp1):
    engine = llm_tp1.engine
    idle = engine.pool.num_free_blocks
    engine.add_request("a", list(range(7, 80)), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("b", list(range(7, 40)), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free_blocks < idle
    assert engine.abort("a") and engine.abort("b")
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished and o.finish_reason == "abort"} == {"a", "b"}
    assert engine.pool.num_free_blocks == idle
    assert not engine.has_unfinished_requests()
