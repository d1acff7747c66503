"""Scoring and fan-out through real processes (one producer, one decode, the proxy; real NIXL):
vLLM's `echo` + `logprobs` + `max_tokens: 0` (lm-eval's loglikelihood) and `prompt_logprobs` equal
transformers' log-softmax, on one instance and through P/D; `n > 1` and lists of prompts through
P/D give the single instance's answers, with each prompt's KV read once by decode."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from clients import client_venv
from helpers import ids
from servers import metric, start_deployment, wait_idle

TOL = 1e-4


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    dep = start_deployment(tiny_model, 1, 1, tmp_path_factory.mktemp("scoring"),
                           proxy_args=["--routing", "least-loaded"])
    yield dep
    dep.stop()


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model):
    """Each prompt token's log-probability given the tokens before it, by transformers."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def score(prompt: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1)
        return lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    return score


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _targets(pd, where: str) -> str:
    return pd.proxy.url if where == "pd" else pd.prefill[0].url


@pytest.mark.parametrize("where", ["single", "pd"])
def test_echo_logprobs_with_max_tokens_0_is_transformers_log_softmax(pd, hf_logprobs, where):
    """lm-eval's local-completions loglikelihood request, read the way it reads it."""
    prompt = ids(40, seed=301)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    answer = _post(_targets(pd, where), "/v1/completions", body)
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) == len(lp["tokens"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(prompt)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], ref)) < TOL
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert choice["text"] and lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("where", ["single", "pd"])
def test_echo_with_generated_tokens(pd, hf_logprobs, where):
    prompt = ids(24, seed=302)
    body = {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0,
            "return_token_ids": True}
    plain = _post(pd.prefill[0].url, "/v1/completions", {**body, "echo": False, "logprobs": None})
    choice = _post(_targets(pd, where), "/v1/completions", body)["choices"][0]
    generated = plain["choices"][0]["text"]
    assert choice["text"].endswith(generated) and len(choice["text"]) > len(generated)
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(prompt) + 3 and lps[0] is None
    assert max(abs(a - b) for a, b in zip(lps[1:len(prompt)], hf_logprobs(prompt))) < TOL


@pytest.mark.parametrize("where", ["single", "pd"])
def test_prompt_logprobs_in_vllms_shape(pd, hf_logprobs, where):
    prompt = ids(40, seed=303)
    body = {"prompt": prompt, "prompt_logprobs": 2, "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    plain = _post(pd.prefill[0].url, "/v1/completions", {**body, "prompt_logprobs": None})
    choice = _post(_targets(pd, where), "/v1/completions", body)["choices"][0]
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    ref = hf_logprobs(prompt)
    for token, entry, expected in zip(prompt[1:], entries[1:], ref):
        assert 2 <= len(entry) <= 3
        mine = entry[str(token)]
        assert abs(mine["logprob"] - expected) < TOL
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(token) or mine["rank"] <= 2)
        assert ranks[:2] == [1, 2]


@pytest.mark.parametrize("where", ["single", "pd"])
def test_chat_prompt_logprobs(pd, where):
    body = {"messages": [{"role": "user", "content": "score this prompt please"}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 0}
    answer = _post(_targets(pd, where), "/v1/chat/completions", body)
    entries = answer["prompt_logprobs"]
    assert len(entries) == answer["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])


@pytest.mark.parametrize("where", ["single", "pd"])
def test_truncate_prompt_tokens_keeps_the_last_tokens(pd, where):
    """vLLM's truncate_prompt_tokens: the answer is the one to the prompt's last k tokens, whose
    count usage reports; through P/D the proxy routes by the same cut. Bad values are 400s naming it."""
    url, prompt = _targets(pd, where), ids(60, seed=77)
    base = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
    want = _post(url, "/v1/completions", {**base, "prompt": prompt[-20:]})
    got = _post(url, "/v1/completions", {**base, "prompt": prompt, "truncate_prompt_tokens": 20})
    assert got["usage"]["prompt_tokens"] == 20 and got["choices"][0]["prompt_token_ids"] == prompt[-20:]
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    whole = _post(url, "/v1/completions", {**base, "prompt": prompt, "truncate_prompt_tokens": -1})
    assert whole["usage"]["prompt_tokens"] == len(prompt)  # shorter than the context: kept whole
    chat = {**base, "messages": [{"role": "user", "content": "a long question " * 20}]}
    full = _post(url, "/v1/chat/completions", chat)["usage"]["prompt_tokens"]
    cut = _post(url, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 9})
    assert full > 9 and cut["usage"]["prompt_tokens"] == 9
    for bad in (0, -2, "8", 10 ** 6):
        r = httpx.post(url + "/v1/completions", json={**base, "prompt": prompt, "truncate_prompt_tokens": bad},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (bad, r.text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_in_a_stream_are_a_400_and_hold_nothing(pd, path):
    """vLLM refuses them in a stream; through P/D the refusal comes before any KV is held."""
    body = {"prompt": "score me", "messages": [{"role": "user", "content": "score me"}], "max_tokens": 2,
            "prompt_logprobs": 1, "stream": True}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    for url in (pd.proxy.url, pd.prefill[0].url):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    for inst in (pd.prefill[0], pd.decode[0]):
        s = wait_idle(inst)
        assert s["num_free_blocks"] == s["num_blocks"], s
    answer = _post(pd.proxy.url, path, {**body, "stream": False})  # the same body unstreamed is served
    assert (answer.get("prompt_logprobs") or answer["choices"][0]["prompt_logprobs"])[1]


def _stream_tokens(url: str, body: dict) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event["choices"]:
                    tokens.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    return tokens


def _token_ids(answer: dict) -> list[list[int]]:
    assert [c["index"] for c in answer["choices"]] == list(range(len(answer["choices"])))
    return [c["token_ids"] for c in answer["choices"]]


def test_n_seeded_through_pd_equals_single_instance_and_reads_once(pd):
    decode = pd.decode[0]
    body = {"prompt": ids(40, seed=304), "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 6,
            "ignore_eos": True, "return_token_ids": True}
    single = _token_ids(_post(pd.prefill[0].url, "/v1/completions", body))
    assert len({tuple(t) for t in single}) > 1  # three samples, not one repeated
    wait_idle(decode)
    before = metric(decode, "pdserve:kv_transfers_total")
    answer = _post(pd.proxy.url, "/v1/completions", body)
    assert _token_ids(answer) == single
    assert answer["usage"]["completion_tokens"] == 18
    wait_idle(decode)
    assert metric(decode, "pdserve:kv_transfers_total") - before == 1  # the prompt's KV, read once
    streamed = _stream_tokens(pd.proxy.url, body)
    assert [streamed[i] for i in range(3)] == single


def test_greedy_n2_through_pd(pd):
    body = {"prompt": ids(30, seed=305), "n": 2, "temperature": 0, "max_tokens": 5,
            "return_token_ids": True}
    single = _token_ids(_post(pd.prefill[0].url, "/v1/completions", body))
    got = _token_ids(_post(pd.proxy.url, "/v1/completions", body))
    assert got == single and got[0] == got[1]


def test_list_of_prompts_through_pd(pd):
    decode = pd.decode[0]
    body = {"prompt": [ids(36, seed=306), ids(20, seed=307)], "n": 2, "seed": 5, "temperature": 0.8,
            "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    single = _token_ids(_post(pd.prefill[0].url, "/v1/completions", body))
    wait_idle(decode)
    before = metric(decode, "pdserve:kv_transfers_total")
    answer = _post(pd.proxy.url, "/v1/completions", body)
    assert _token_ids(answer) == single
    assert answer["usage"]["prompt_tokens"] == 56 and answer["usage"]["completion_tokens"] == 20
    wait_idle(decode)
    assert metric(decode, "pdserve:kv_transfers_total") - before == 2  # once per prompt
    streamed = _stream_tokens(pd.proxy.url, body)
    assert [streamed[i] for i in range(4)] == single


@pytest.mark.parametrize("where", ["single", "pd"])
def test_streamed_echo_carries_the_prompts_logprobs_first(pd, hf_logprobs, where):
    prompt = ids(24, seed=308)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "stream": True}
    firsts = []
    with httpx.stream("POST", _targets(pd, where) + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                firsts += [c for c in json.loads(line[6:])["choices"] if c.get("logprobs")][:1]
    lps = firsts[0]["logprobs"]["token_logprobs"]
    assert len(lps) >= len(prompt) and lps[0] is None
    assert max(abs(a - b) for a, b in zip(lps[1:len(prompt)], hf_logprobs(prompt))) < TOL



@pytest.mark.parametrize("stream", [False, True])
def test_chat_n_seeded_through_pd_equals_single_instance(pd, stream):
    body = {"messages": [{"role": "user", "content": "tell me about the decode server " * 3}], "n": 2, "seed": 3,
            "temperature": 1.0, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    single = _post(pd.prefill[0].url, "/v1/chat/completions", body)
    if not stream:
        got = _post(pd.proxy.url, "/v1/chat/completions", body)
        assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in single["choices"]]
        return
    tokens: dict[int, list[int]] = {}
    with httpx.stream("POST", pd.proxy.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    tokens.setdefault(c["index"], []).extend(c.get("token_ids") or [])
    assert [tokens[i] for i in range(2)] == [c["token_ids"] for c in single["choices"]]

# --- lm-eval's loglikelihood (local-completions), in a venv of its own --------------------------------

LM_EVAL = "lm-eval[api]==0.4.13"  # [api]: local-completions' client
LM_EVAL_SCRIPT = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
tokenizer, task_dir, *urls = sys.argv[1:]
out = {}
for url in urls:
    args = (f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
            "num_concurrent=1,max_retries=1,batch_size=3")
    res = simple_evaluate(model="local-completions", model_args=args, tasks=["pdserve_tiny"],
                          task_manager=TaskManager(include_path=task_dir), log_samples=True)
    samples = sorted(res["samples"]["pdserve_tiny"], key=lambda s: s["doc_id"])
    out[url] = [[float(r[0][0]) for r in s["resps"]] for s in samples]
print("RESULT " + json.dumps(out))
"""
TASK = """task: pdserve_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
DOCS = [{"question": "The prefill server sends the cache to", "choices": [" the decode server", " nobody", " a cat"],
         "answer": 0},
        {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
        {"question": "A block of keys and values", "choices": [" moves over the wire", " stays", " is read once"],
         "answer": 2}]


@pytest.fixture(scope="module")
def lm_eval_python() -> Path:
    """lm-eval sees this venv's packages, torch pinned to the installed build (tests/clients.py)."""
    return client_venv(LM_EVAL, "import lm_eval, tenacity", see_our_packages=True) / "bin" / "python"


def test_lm_eval_loglikelihood_through_pd_equals_one_instance(pd, lm_eval_python, tiny_model, tmp_path):
    """lm-eval 0.4's local-completions scores each choice with echo, logprobs and batches of three
    prompts (the proxy splits them): through P/D it equals the producer serving alone."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "pdserve_tiny.yaml").write_text(TASK.format(data=data))
    script = tmp_path / "run_lm_eval.py"
    script.write_text(LM_EVAL_SCRIPT)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "OMP_NUM_THREADS": "1"}
    single, through = pd.prefill[0].url, pd.proxy.url
    run = subprocess.run([str(lm_eval_python), str(script), tiny_model, str(tmp_path), single, through],
                         capture_output=True, text=True, timeout=300, env=env)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert run.returncode == 0 and line, run.stderr[-3000:]
    scores = json.loads(line[len("RESULT "):])
    assert [len(s) for s in scores[single]] == [len(d["choices"]) for d in DOCS]
    flat = [(a, b) for sa, sb in zip(scores[single], scores[through]) for a, b in zip(sa, sb)]
    assert all(a < 0 for a, _ in flat)
    assert max(abs(a - b) for a, b in flat) < TOL


def test_echo_of_a_list_of_texts_gives_each_text_back(pd):
    texts = ["first prompt, echoed", "the second one"]
    answer = _post(pd.prefill[0].url, "/v1/completions", {"prompt": texts, "echo": True, "max_tokens": 0})
    assert [c["text"] for c in answer["choices"]] == texts
