"""Per-request logits controls on rank 0, in vLLM v1's semantics: allowed_token_ids, bad_words,
min_tokens, logit_bias, then the three penalties (repetition counting the prompt), min_p after
temperature; a batch mixing requests with and without controls samples the plain ones unchanged."""

from __future__ import annotations

import torch

from pdserve.worker.messages import LogitsControls, SamplingSpec
from pdserve.worker.sampler import Sampler

V = 8


def spec(controls: LogitsControls | None = None, **kw) -> SamplingSpec:
    base = dict(temperature=0.0, top_p=1.0, top_k=0, seed=None, num_logprobs=None)
    return SamplingSpec(**{**base, **kw}, controls=controls)


def greedy(logits: list[float], controls: LogitsControls, steps: int = 1) -> list[int]:
    s = Sampler(len(logits))
    s.add("r", spec(controls))
    x = torch.tensor([logits])
    return [s.sample(x, ["r"])[0].token_id for _ in range(steps)]


def vllm_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties (model_executor/layers/utils.py), written out for one row."""
    x = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel()).float() \
        if output else torch.zeros_like(x)
    seen = counts > 0
    if prompt:
        seen = seen | (torch.bincount(torch.tensor(prompt), minlength=x.numel()) > 0)
    rep = torch.where(seen, torch.tensor(repetition), torch.tensor(1.0))
    x = torch.where(x > 0, x / rep, x * rep)
    return x - frequency * counts - presence * (counts > 0).float()


def test_logit_bias_moves_the_greedy_choice_and_adds_to_the_logit():
    logits = [0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    assert greedy(logits, LogitsControls(logit_bias=[(2, 2.5)])) == [2]
    assert greedy(logits, LogitsControls(logit_bias=[(1, -100.0)])) == [3]
    assert greedy(logits, LogitsControls(logit_bias=[(2, 1.9)])) == [1]  # 2.9 < 3


def test_allowed_token_ids_confine_greedy_and_sampled_tokens():
    logits = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0]
    assert greedy(logits, LogitsControls(allowed_token_ids=[3, 6])) == [3]
    s = Sampler(V)
    s.add("r", spec(LogitsControls(allowed_token_ids=[2, 5, 7]), temperature=1.0, seed=3))
    x = torch.zeros(1, V)
    drawn = {s.sample(x, ["r"])[0].token_id for _ in range(200)}
    assert drawn == {2, 5, 7}


def test_bad_words_ban_a_single_token_always_and_a_sequence_only_after_its_prefix():
    logits = [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    assert greedy(logits, LogitsControls(bad_words_token_ids=[[3]]), steps=3) == [2, 2, 2]
    # [2, 3]: 3 is banned only right after 2. Greedy: 3 (no prefix yet), then 3 again (last is 3)
    assert greedy(logits, LogitsControls(bad_words_token_ids=[[2, 3]]), steps=2) == [3, 3]
    # after a 2 (from the P/D producer, or sampled), 3 is banned once
    c = LogitsControls(bad_words_token_ids=[[2, 3]], output_token_ids=[2])
    assert greedy(logits, c, steps=2) == [2, 2]  # 2 again, so 3 stays banned


def test_min_tokens_masks_stop_ids_until_enough_outputs_counting_earlier_ones():
    logits = [0.0, 1.0, 2.0, 9.0, 0.0, 0.0, 0.0, 0.0]  # 3 is EOS
    c = LogitsControls(min_tokens=3, min_tokens_stop_ids=[3])
    assert greedy(logits, c, steps=4) == [2, 2, 2, 3]
    # a P/D consumer's first token (made by the producer) counts as one output
    c = LogitsControls(min_tokens=3, min_tokens_stop_ids=[3], output_token_ids=[2])
    assert greedy(logits, c, steps=3) == [2, 2, 3]


def test_penalties_match_vllms_formula_and_count_the_prompt_for_repetition_only():
    torch.manual_seed(0)
    raw = torch.randn(V) * 3
    prompt, output = [1, 1, 4], [2, 2, 5]
    for presence, frequency, repetition in [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.8),
                                            (1.0, -0.3, 0.6), (-2.0, 2.0, 1.3)]:
        c = LogitsControls(presence_penalty=presence, frequency_penalty=frequency,
                           repetition_penalty=repetition, output_token_ids=output,
                           prompt_token_ids=prompt if repetition != 1.0 else None)
        s = Sampler(V)
        s.add("r", spec(c))
        got = s.adjusted(raw[None].clone(), ["r"])[1][0]
        want = vllm_penalties(raw, prompt if repetition != 1.0 else [], output, presence, frequency, repetition)
        assert torch.allclose(got, want, atol=1e-6), (presence, frequency, repetition)


def test_penalties_follow_the_tokens_the_sampler_draws():
    logits = [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    # each draw costs its token 1.5 (vLLM counts output tokens): 3; 2 (1.5 < 2); 3 (1.5 > 0.5 and 1);
    # then 1 (3 and 2 are at 0 and 0.5)
    assert greedy(logits, LogitsControls(frequency_penalty=1.5), steps=4) == [3, 2, 3, 1]
    # repetition_penalty on a prompt token: 3 / 2 = 1.5 < 2
    assert greedy(logits, LogitsControls(repetition_penalty=2.0, prompt_token_ids=[3])) == [2]


def test_order_logit_bias_before_repetition_penalty():
    """vLLM applies logit_bias (a logits processor) before penalties: (1 + 3) / 2 = 2 > 1.5."""
    logits = [0.0, 1.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    c = LogitsControls(logit_bias=[(1, 3.0)], repetition_penalty=2.0, prompt_token_ids=[1])
    assert greedy(logits, c) == [1]


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.04, 0.03, 0.02, 0.01, 0.0]]) + 1e-12)
    s = Sampler(V)
    s.add("r", spec(temperature=1.0, seed=5, min_p=0.15))  # keeps p >= 0.075: tokens 0, 1, 2
    drawn = {s.sample(x, ["r"])[0].token_id for _ in range(300)}
    assert drawn == {0, 1, 2}


def test_logprobs_stay_the_raw_models():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    s = Sampler(V)
    s.add("r", spec(LogitsControls(logit_bias=[(2, 5.0)]), num_logprobs=1))
    (tok,) = s.sample(logits, ["r"])
    lp = torch.log_softmax(logits[0], -1)
    assert tok.token_id == 2 and abs(tok.logprob - lp[2].item()) < 1e-6
    assert tok.top_logprobs[0][0] == 1


def test_a_batch_mixing_plain_and_controlled_requests_samples_the_plain_ones_unchanged():
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    plain, mixed = Sampler(64), Sampler(64)
    for s in (plain, mixed):
        s.add("g", spec())
        s.add("t", spec(temperature=0.8, seed=11, top_p=0.9))
    mixed.add("c1", spec(LogitsControls(frequency_penalty=2.0, logit_bias=[(0, 50.0)])))
    mixed.add("c2", spec(LogitsControls(allowed_token_ids=[5]), temperature=1.0, seed=2))
    for _ in range(5):
        a = plain.sample(logits[:2], ["g", "t"])
        b = mixed.sample(logits[[0, 2, 1, 3]], ["g", "c1", "t", "c2"])
        assert [a[0].token_id, a[1].token_id] == [b[0].token_id, b[2].token_id]
        assert b[3].token_id == 5
    # c1: token 0 (+50) first, then its frequency penalty (2 per draw) is no match for +50
    assert b[1].token_id == 0


def test_requests_without_controls_are_not_adjusted():
    s = Sampler(V)
    s.add("a", spec())
    s.add("b", spec(LogitsControls(logit_bias=[(0, 1.0)])))
    rows, adjusted = s.adjusted(torch.zeros(2, V), ["a", "b"])
    assert rows == [1] and adjusted.shape == (1, V)
    assert s.adjusted(torch.zeros(1, V), ["a"]) == ([], None)
