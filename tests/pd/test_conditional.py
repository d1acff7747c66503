"""Conditional disaggregation through real processes (`pdserve proxy --local-prefill-max-tokens`):
decode prefills a short prompt itself, with no transfer; a long one is prefilled by the producer and
decode READs it. Either way the answer is transformers' and each response says which it was
(`X-PD-Decision`, and the proxy's `pd_decisions` counter)."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers import assert_greedy_match, hf_reference, ids
from servers import metric, pd_decisions, start_deployment, wait_idle

LOCAL_MAX = 64
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("conditional")
    dep = start_deployment(tiny_model, 1, 1, log_dir,
                           proxy_args=["--local-prefill-max-tokens", str(LOCAL_MAX)])
    dep.model = tiny_model
    yield dep
    dep.stop()


def _counters(decode) -> tuple[float, float]:
    return metric(decode, "pdserve:kv_transfers_total"), metric(decode, "pdserve:prompt_tokens_computed_total")


def _ask(proxy, prompt: list[int], stream: bool) -> tuple[str, list[int]]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            "stream": stream}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", proxy.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            if not stream:
                return r.headers["X-PD-Decision"], json.loads(r.read())["choices"][0]["token_ids"]
            tokens = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
            return r.headers["X-PD-Decision"], tokens


@pytest.mark.parametrize("stream", [False, True])
def test_decode_prefills_a_short_prompt_itself(pd, stream):
    decode, p = pd.decode[0], ids(LOCAL_MAX - 4, seed=50 + stream)
    transfers, computed = _counters(decode)
    before = pd_decisions(pd.proxy).get("local", 0)
    decision, tokens = _ask(pd.proxy, p, stream)
    assert decision == "local"
    assert_greedy_match(tokens, hf_reference(pd.model, p, MAX_TOKENS), "short prompt, local")
    assert _counters(decode) == (transfers, computed + len(p))  # no READ: decode computed the prompt
    assert pd_decisions(pd.proxy).get("local", 0) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_prompt_is_prefilled_by_the_producer_and_read(pd, stream):
    decode, p = pd.decode[0], ids(3 * LOCAL_MAX, seed=40 + stream)
    transfers, computed = _counters(decode)
    before = pd_decisions(pd.proxy).get("remote", 0)
    decision, tokens = _ask(pd.proxy, p, stream)
    assert decision == "remote"
    assert_greedy_match(tokens, hf_reference(pd.model, p, MAX_TOKENS), "long prompt, remote")
    assert _counters(decode) == (transfers + 1, computed)  # one READ; decode computed no prompt token
    assert pd_decisions(pd.proxy).get("remote", 0) == before + 1
    for inst in pd.instances:
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"], inst.role
