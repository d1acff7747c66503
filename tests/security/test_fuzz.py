"""Property-based fuzzing of what clients send (request bodies, and `kv_transfer_params` a client
hands straight to a decode instance) against running instances: whatever arrives, the answer is
never a 5xx, the engines stay up, and no block leaks."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS, get_json, wait_idle

# Numbers at every edge an engine has: 32 and 64 bits, signs, floats that are not finite.
EDGE_INTS = st.sampled_from([0, 1, -1, 2, 16, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63 - 1,
                             10 ** 30])
NUMBERS = st.one_of(EDGE_INTS, st.integers(), st.floats(allow_nan=True, allow_infinity=True))
JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20)),
                       lambda inner: st.one_of(st.lists(inner, max_size=4),
                                               st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=12)
FIELDS = ["n", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "logprobs",
          "top_logprobs", "stream", "ignore_eos", "max_completion_tokens", "presence_penalty", "echo",
          "chat_template", "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
          "return_token_ids", "stream_options", "model", "frequency_penalty", "repetition_penalty", "min_p",
          "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "best_of", "use_beam_search", "request_id"]
KV_KEYS = ["do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host", "remote_port",
           "remote_block_ids", "remote_request_id", "tp_size", "first_token_id", "first_token_logprob",
           "first_token_top_logprobs", "prompt_hash", "lease_s", "expires_at", "signature"]
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    d = Deployment(tiny_model, [1], [1], instance_args=[*INSTANCE_ARGS, "--kv-lease-s", "3",
                                                        "--kv-transfer-timeout-s", "2"],
                   log_dir=str(tmp_path_factory.mktemp("fuzz")))
    d.start(timeout_s=120)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


def post(client, url: str, body) -> httpx.Response:
    return client.post(url, content=json.dumps(body, allow_nan=True).encode(),
                       headers={"Content-Type": "application/json"})


def assert_not_5xx(r: httpx.Response, body) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300], body)
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text[:300]


@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSONISH, max_size=4),
       prompt=st.one_of(st.text(max_size=30), st.lists(EDGE_INTS, max_size=5), JSONISH),
       chat=st.booleans())
@example(fields={"n": "0"}, prompt="", chat=False)  # the proxy compared "0" with 1: a 500 (found in session 8)
@SETTINGS
def test_request_bodies_never_break_an_instance(dep, client, fields, prompt, chat):
    if chat:
        body = {"messages": [{"role": "user", "content": prompt if isinstance(prompt, str) else "hi"}]}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": prompt}
        path = "/v1/completions"
    body = {"max_tokens": 4, **body, **fields}
    for url in (dep.proxy.url, dep.decode[0].url):
        assert_not_5xx(post(client, url + path, body), body)


@given(kv=st.dictionaries(st.sampled_from(KV_KEYS), JSONISH, max_size=8), use_real=st.booleans())
@SETTINGS
def test_transfer_params_never_break_an_instance(dep, client, kv, use_real):
    """Fuzzed params straight to the decode instance (a client that reaches it), alone or mixed
    into real params the producer issued."""
    prompt = [1] + [random.Random(len(kv)).randrange(7, 1000) for _ in range(20)]
    if use_real:
        r = post(client, dep.prefill[0].url + "/v1/completions",
                 {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200
        kv = {**r.json()["kv_transfer_params"], **kv}
    body = {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv}
    assert_not_5xx(post(client, dep.decode[0].url + "/v1/completions", body), body)


def test_after_the_fuzzing_every_engine_is_up_and_every_block_back(dep, client):
    for inst in dep.instances:
        assert client.get(inst.url + "/health").status_code == 200
        s = wait_idle(inst, timeout_s=30)
        assert s["num_free_blocks"] == s["num_blocks"], (inst.role, s)
        assert get_json(inst.url + "/debug/stats")["num_running"] == 0
    r = post(client, dep.proxy.url + "/v1/completions", {"prompt": "still answering", "max_tokens": 4})
    assert r.status_code == 200
