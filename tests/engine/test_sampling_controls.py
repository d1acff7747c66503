"""Every sampling control through the real engine (tiny model, TP 1): stop_token_ids end the answer,
min_tokens holds stops back, logit_bias / allowed_token_ids / bad_words steer the tokens, penalties
change a greedy answer; token ids outside the vocabulary are refused naming the field."""

from __future__ import annotations

import random

import pytest

from pdserve import SamplingParams
from pdserve.sampling_params import InvalidRequestError

N = 12


def prompt(llm, n: int = 20, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(7, llm.engine.spec.vocab_size) for _ in range(n - 1)]


def run(llm, **kw) -> tuple[list[int], str, object]:
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kw)
    (out,) = llm.generate([prompt(llm)], params)
    c = out.outputs[0]
    return c.token_ids, c.finish_reason, c.stop_reason


def test_stop_token_ids_end_the_answer_at_that_token(llm_tp1):
    plain, _, _ = run(llm_tp1)
    tokens, reason, stop = run(llm_tp1, stop_token_ids=(plain[3],))
    first = plain.index(plain[3])
    assert tokens == plain[:first + 1] and reason == "stop" and stop == plain[3]


def test_min_tokens_masks_stop_tokens_until_enough_were_generated(llm_tp1):
    plain, _, _ = run(llm_tp1)
    tokens, _, _ = run(llm_tp1, stop_token_ids=(plain[0],), min_tokens=4)
    assert plain[0] not in tokens[:4] and len(tokens) >= 4


def test_logit_bias_allowed_token_ids_and_bad_words_steer_the_tokens(llm_tp1):
    plain, _, _ = run(llm_tp1)
    assert run(llm_tp1, logit_bias={42: 100.0})[0] == [42] * N
    allowed = (plain[0], 17, 99)
    tokens, _, _ = run(llm_tp1, allowed_token_ids=allowed)
    assert set(tokens) <= set(allowed) and tokens[0] == plain[0]
    word = llm_tp1.tokenizer.decode([plain[0]])
    banned, _, _ = run(llm_tp1, bad_words=(word,))
    assert banned[0] != plain[0]


def test_penalties_counter_a_forced_repetition(llm_tp1):
    """The random model never repeats itself; a bias on one token makes it, and the penalties
    (vLLM's: frequency counts outputs, repetition also the prompt) undo it."""
    forced = run(llm_tp1, logit_bias={42: 30.0})[0].count(42)
    assert forced >= N // 2
    assert run(llm_tp1, logit_bias={42: 30.0}, frequency_penalty=2.0)[0].count(42) < forced
    in_prompt = prompt(llm_tp1)[5]
    rep, _, _ = run(llm_tp1, logit_bias={in_prompt: 40.0}, repetition_penalty=50.0)
    assert rep[0] != in_prompt


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={10 ** 6: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=(5, 10 ** 6)), "allowed_token_ids"),
    (dict(min_tokens=N + 1), "min_tokens"),
])
def test_out_of_range_controls_are_refused_naming_the_field(llm_tp1, kw, field):
    with pytest.raises(InvalidRequestError) as e:
        run(llm_tp1, **kw)
    assert e.value.field == field
