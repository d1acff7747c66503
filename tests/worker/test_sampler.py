"""Sampler: greedy, top-k/top-p truncation, seeds, and the P/D first-token skip."""

from __future__ import annotations

import torch

from pdserve.worker.messages import SamplingSpec
from pdserve.worker.sampler import Sampler


def spec(**kw) -> SamplingSpec:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, seed=None, num_logprobs=None)
    return SamplingSpec(**{**base, **kw})


def test_greedy_and_logprobs():
    s = Sampler(5)
    s.add("r", spec(temperature=0.0, num_logprobs=2))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    (tok,) = s.sample(logits, ["r"])
    assert tok.token_id == 1
    lp = torch.log_softmax(logits[0], -1)
    assert abs(tok.logprob - lp[1].item()) < 1e-6
    assert [t for t, _ in tok.top_logprobs] == [1, 3]


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    s = Sampler(4)
    s.add("k", spec(top_k=2, seed=1))
    s.add("p", spec(top_p=0.5, seed=2))  # token 0 alone holds > 50 % of the mass
    ks = {s.sample(logits, ["k"])[0].token_id for _ in range(200)}
    ps = {s.sample(logits, ["p"])[0].token_id for _ in range(50)}
    assert ks <= {0, 1} and len(ks) == 2
    assert ps == {0}


def test_seed_reproducible_and_presampled_skip_continues_the_stream():
    logits = torch.zeros(1, 50)
    a, b = Sampler(50), Sampler(50)
    a.add("r", spec(seed=7))
    stream = [a.sample(logits, ["r"])[0].token_id for _ in range(6)]
    b.add("r", spec(seed=7, num_presampled=1))  # a decode instance continuing from token 1
    assert [b.sample(logits, ["r"])[0].token_id for _ in range(5)] == stream[1:]
