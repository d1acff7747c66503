"""The mock engine through real processes: a 2P1D deployment of `pdserve serve --mock-engine` answers
with the mock's tokens, which are a function of the whole context as read back from the KV cache, so
they come out right only if the producer's KV arrived intact over real NIXL; nothing is computed on
a core, and nothing leaks. Sibling requests that arrive together with a shared prefix have it
computed once (one producer, one prefill of it)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ids
from pdserve.launcher import Deployment
from pdserve.model.spec import ModelSpec
from pdserve.worker.mock_runner import next_token
from servers import INSTANCE_ARGS, get_json, metric, post_json, wait_idle


@pytest.fixture(scope="module")
def mock_pd(tiny_model, tmp_path_factory):
    dep = Deployment(tiny_model, [1, 1], [1], instance_args=[*INSTANCE_ARGS, "--mock-engine", "--mock-speedup", "20"],
                     log_dir=str(tmp_path_factory.mktemp("mock")))
    dep.start(timeout_s=120)
    dep.vocab = ModelSpec.from_dir(tiny_model).vocab_size
    yield dep
    dep.stop()


def mock_answer(prompt: list[int], n: int, vocab: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(next_token(prompt + out, vocab))
    return out


def test_mock_instances_answer_from_the_kv_they_read(mock_pd):
    before = sum(metric(d, "pdserve:kv_transfers_total") for d in mock_pd.decode)
    for n in (5, 40, 100):
        p = ids(n, seed=1300 + n)
        code, body = post_json(mock_pd.proxy.url + "/v1/completions",
                               {"prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        assert code == 200, body
        assert body["choices"][0]["token_ids"] == mock_answer(p, 8, mock_pd.vocab)
    after = sum(metric(d, "pdserve:kv_transfers_total") for d in mock_pd.decode)
    assert after - before == 3  # every prompt's KV was READ by decode
    for inst in mock_pd.instances:
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"]


def test_a_mock_never_pairs_with_a_real_engine(mock_pd, tiny_model, tmp_path_factory):
    real = Deployment(tiny_model, [1], [1], instance_args=INSTANCE_ARGS, log_dir=str(tmp_path_factory.mktemp("real")),
                      env={"PDSERVE_KV_SECRET": mock_pd.env["PDSERVE_KV_SECRET"]})  # signed alike: only the model differs
    real.start(timeout_s=120)
    try:
        p = ids(30, seed=1400)
        code, answer = post_json(mock_pd.prefill[0].url + "/v1/completions",
                                 {"prompt": p, "max_tokens": 4, "kv_transfer_params": {"do_remote_decode": True}})
        assert code == 200
        code, body = post_json(real.decode[0].url + "/v1/completions",
                               {"prompt": p, "max_tokens": 4, "kv_transfer_params": answer["kv_transfer_params"]})
        assert code != 200 and "weights=mock" in str(body)  # the handshake names what differs
    finally:
        real.stop()
    assert get_json(mock_pd.proxy.url + "/health")


def test_siblings_arriving_together_compute_their_shared_prefix_once(mock_pd):
    prefix = ids(480, seed=1500)  # 30 blocks nobody caches; each sibling adds 16 tokens of its own
    prompts = [prefix + ids(16, seed=1510 + i) for i in range(3)]
    before = sum(metric(p, "pdserve:prompt_tokens_computed_total") for p in mock_pd.prefill)

    def ask(p):
        return post_json(mock_pd.proxy.url + "/v1/completions",
                         {"prompt": p, "max_tokens": 4, "temperature": 0, "return_token_ids": True})
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, prompts))
    for p, (code, body) in zip(prompts, answers):
        assert code == 200, body
        assert body["choices"][0]["token_ids"] == mock_answer(p, 4, mock_pd.vocab)
    computed = sum(metric(p, "pdserve:prompt_tokens_computed_total") for p in mock_pd.prefill) - before
    assert computed == 480 + 3 * 16  # one producer computed the prefix, once
