"""What clients built for vLLM see of a pdserve deployment (issue 23): signed params that survive a
router re-printing JSON numbers, vLLM's metric names, `/version`, `/ping`, `/tokenize`,
`/detokenize`, continuous usage stats, `max_completion_tokens` and `cached_tokens`, on an instance
and through the proxy; and vLLM's own router (PyPI `vllm-router`, in a venv of its own under
~/.cache/pdserve-clients) in its P/D mode. One producer, one decode instance, the proxy routing
least-loaded (every request goes P -> D)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import client_venv
from helpers import ids
from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS

PROMPT = "The prefill server sends the cache to the decode server"


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    d = Deployment(tiny_model, [1], [1], instance_args=INSTANCE_ARGS, proxy_args=["--routing", "least-loaded"],
                   log_dir=str(tmp_path_factory.mktemp("vllm-clients")))
    d.start(timeout_s=120)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as c:
        yield c


# --- 1. signed params through a router that re-prints every JSON number ------------------------------

def reprinted(text: str, number_format) -> str:
    """JSON as a router that parses it and prints it again passes it on: every float printed by
    `number_format` (other digits, or one ulp off, as a parser that is not exact reads it)."""
    return json.dumps(json.loads(text, parse_float=lambda s: number_format(float(s))))


FORMATS = {"15 digits": lambda x: float(f"{x:.15g}"), "one ulp off": lambda x: math.nextafter(x, 0.0)}


def reprinting_router(http, dep, path: str, body: dict, number_format) -> httpx.Response:
    """vllm-router's P/D mode, re-encoding the producer's answer before decode sees its params."""
    p = http.post(dep.prefill[0].url + path, json={**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert p.status_code == 200, p.text
    kv = json.loads(reprinted(p.text, number_format))["kv_transfer_params"]
    return http.post(dep.decode[0].url + path, content=reprinted(json.dumps({**body, "kv_transfer_params": kv}),
                                                                 number_format),
                     headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": PROMPT, "logprobs": 3}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                                   "logprobs": True, "top_logprobs": 2})])
def test_signed_params_survive_a_router_that_reprints_numbers(http, dep, fmt, path, extra):
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    r = reprinting_router(http, dep, path, body, FORMATS[fmt])
    assert r.status_code == 200, r.text
    expected = http.post(dep.proxy.url + path, json=body).json()
    got, want = r.json()["choices"][0], expected["choices"][0]
    if path == "/v1/completions":
        assert got["text"] == want["text"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
    else:
        assert got["message"]["content"] == want["message"]["content"]
        assert [t["logprob"] for t in got["logprobs"]["content"]] == \
            pytest.approx([t["logprob"] for t in want["logprobs"]["content"]], abs=1e-5)


# --- 2. vLLM's metric names ------------------------------------------------------------------------------

VLLM_SAMPLES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                *(f"vllm:request_{phase}_time_seconds_count" for phase in ("queue", "prefill", "decode", "inference")),
                "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
                "vllm:request_params_n_sum", "vllm:request_params_max_tokens_sum"]


def vllm_samples(http, url: str) -> dict[str, float]:
    text = http.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:") and "le" not in s.labels and not s.name.endswith("_created"):
                assert s.labels == {"model_name": "tiny", "engine": "0"} or \
                    s.name == "vllm:request_success_total", (s.name, s.labels)
                out[s.name] = s.value
    return out


def test_vllm_metric_names_and_labels_move_with_a_request(http, dep):
    url = dep.decode[0].url
    before = vllm_samples(http, url)
    assert set(VLLM_SAMPLES) <= set(before), set(VLLM_SAMPLES) - set(before)
    prompt = ids(40, seed=23)
    r = http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    after = vllm_samples(http, url)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == len(prompt)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 8
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == len(prompt)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert after[name] - before[name] == 1, name
    assert after["vllm:inter_token_latency_seconds_count"] > before["vllm:inter_token_latency_seconds_count"]
    assert after["vllm:time_per_output_token_seconds_count"] == after["vllm:inter_token_latency_seconds_count"]
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1 and after["vllm:num_requests_running"] == 0
    grew = {name: after[name] - before[name] for name in after if name.startswith("vllm:request_")}
    assert (grew["vllm:request_prompt_tokens_sum"], grew["vllm:request_generation_tokens_sum"],
            grew["vllm:request_params_n_sum"], grew["vllm:request_params_max_tokens_sum"]) == (len(prompt), 8, 1, 8)
    phase = {p: grew[f"vllm:request_{p}_time_seconds_sum"] for p in ("queue", "prefill", "decode", "inference")}
    assert all(grew[f"vllm:request_{p}_time_seconds_count"] == 1 for p in phase), grew
    assert phase["decode"] > 0 and phase["inference"] == pytest.approx(phase["prefill"] + phase["decode"], abs=1e-6)
    e2e = after["vllm:e2e_request_latency_seconds_sum"] - before["vllm:e2e_request_latency_seconds_sum"]
    assert phase["queue"] + phase["inference"] <= e2e + 0.05  # e2e counts from the server's start, a hair later


# --- 3. /version, /ping, /tokenize, /detokenize ---------------------------------------------------------

def test_version_and_ping_on_instances_and_proxy(http, dep):
    for url in (dep.decode[0].url, dep.prefill[0].url, dep.proxy.url):
        v = http.get(url + "/version")
        assert v.status_code == 200 and isinstance(v.json()["version"], str) and v.json()["version"], v.text
        assert http.get(url + "/ping").status_code == 200
        assert http.post(url + "/ping").status_code == 200


def test_tokenize_and_detokenize_match_what_generation_sees(http, dep):
    completion = http.post(dep.decode[0].url + "/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 1, "return_token_ids": True}).json()["choices"][0]["prompt_token_ids"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    chat = http.post(dep.decode[0].url + "/v1/chat/completions", json={
        "messages": messages, "max_tokens": 1, "return_token_ids": True}).json()["prompt_token_ids"]
    max_len = http.get(dep.decode[0].url + "/v1/models").json()["data"][0]["max_model_len"]
    for url in (dep.decode[0].url, dep.proxy.url):
        t = http.post(url + "/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
        assert t == {"count": len(completion), "max_model_len": max_len, "tokens": completion}, t
        plain = http.post(url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert completion[-len(plain["tokens"]):] == plain["tokens"] and plain["count"] <= len(completion)
        c = http.post(url + "/tokenize", json={"messages": messages}).json()
        assert c["tokens"] == chat and c["count"] == len(chat)
        no_prompt = http.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert chat[:no_prompt["count"]] == no_prompt["tokens"] and no_prompt["count"] < len(chat)
        strs = http.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
        assert len(strs["token_strs"]) == len(completion)
        d = http.post(url + "/detokenize", json={"model": "tiny", "tokens": plain["tokens"]})
        assert d.json() == {"prompt": PROMPT}, d.text
        bad = http.post(url + "/detokenize", json={"tokens": [10 ** 9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text
        missing = http.post(url + "/tokenize", json={"add_special_tokens": True})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt", missing.text


# --- 4. continuous usage stats, max_completion_tokens, cached_tokens --------------------------------------

def events(http, url: str, path: str, body: dict) -> list[dict]:
    with http.stream("POST", url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_on_every_chunk(http, dep, path):
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]})}
    for url in (dep.decode[0].url, dep.proxy.url):
        chunks = events(http, url, path, body)
        final = chunks[-1]["usage"]
        assert final["completion_tokens"] == 5 and chunks[-1]["choices"] == []
        seen = [c["usage"] for c in chunks[:-1]]
        assert all(u is not None and u["prompt_tokens"] == final["prompt_tokens"] for u in seen), (url, seen)
        counts = [u["completion_tokens"] for u in seen]
        assert counts == sorted(counts) and counts[-1] == 5 and all(
            u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in seen), (url, counts)
        plain = events(http, url, path, {**body, "stream_options": {"include_usage": True}})
        assert all(c.get("usage") is None for c in plain[:-1]) and plain[-1]["usage"] == final


def test_max_completion_tokens_on_completions(http, dep):
    for url in (dep.decode[0].url, dep.proxy.url):
        r = http.post(url + "/v1/completions", json={"prompt": PROMPT, "max_completion_tokens": 3, "max_tokens": 9,
                                                     "temperature": 0, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length", r


def test_cached_tokens_through_the_proxy(http, dep):
    """A prompt prefilled a second time finds its full blocks in the producer's prefix cache; the
    client sees that as a single instance reports it."""
    prompt = ids(70, seed=2323)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    direct = http.post(dep.prefill[0].url + "/v1/completions", json=body).json()["usage"]
    again = http.post(dep.prefill[0].url + "/v1/completions", json=body).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached and cached >= len(prompt) // 2, (direct, again)
    through = http.post(dep.proxy.url + "/v1/completions", json=body)
    assert through.headers.get("X-PD-Decision") == "remote"
    assert (through.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") == cached, through.json()
    streamed = events(http, dep.proxy.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert (streamed[-1]["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") == cached, streamed[-1]


# --- 5. vLLM's own Rust router in its P/D mode, with logprobs ---------------------------------------------

ROUTER = "vllm-router==0.1.17"


@pytest.fixture(scope="module")
def vllm_router_bin() -> Path:
    return client_venv(ROUTER, "import os, sys; sys.exit(not os.path.exists(sys.prefix + '/bin/vllm-router'))") \
        / "bin" / "vllm-router"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_router(vllm_router_bin, dep, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm-router") / "router.log", "wb")
    proc = subprocess.Popen([str(vllm_router_bin), "--vllm-pd-disaggregation", "--host", "127.0.0.1",
                             "--port", str(port), "--prefill", dep.prefill[0].url, "--decode", dep.decode[0].url,
                             "--policy", "round_robin", "--worker-startup-timeout-secs", "30",
                             "--disable-retries", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"vllm-router exited with {proc.returncode}: see {log.name}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"vllm-router not up in 30 s: see {log.name}"
        time.sleep(0.2)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    log.close()


def test_vllm_router_pd_mode_with_logprobs(http, dep, vllm_router):
    """vllm-router hands the producer's params to decode (re-encoding the JSON); with logprobs every
    answer equals pdserve's proxy's, and decode READ the KV."""
    transfers = [s for f in text_string_to_metric_families(http.get(dep.decode[0].url + "/metrics").text)
                 for s in f.samples if s.name == "pdserve:kv_transfers_total"][0].value
    for i in range(6):
        path, body = ("/v1/completions", {"prompt": ids(30 + i, seed=i), "logprobs": 2}) if i % 2 else \
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
                                      "logprobs": True, "top_logprobs": 2})
        body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, **body}
        r = http.post(vllm_router + path, json=body)
        assert r.status_code == 200, r.text
        want = http.post(dep.proxy.url + path, json=body).json()["choices"][0]
        got = r.json()["choices"][0]
        if i % 2:
            assert got["text"] == want["text"]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
        else:
            assert got["message"]["content"] == want["message"]["content"]
            assert [t["logprob"] for t in got["logprobs"]["content"]] == \
                pytest.approx([t["logprob"] for t in want["logprobs"]["content"]], abs=1e-5)
    after = [s for f in text_string_to_metric_families(http.get(dep.decode[0].url + "/metrics").text)
             for s in f.samples if s.name == "pdserve:kv_transfers_total"][0].value
    assert after - transfers >= 6  # the router's six and the proxy's six went P -> D
