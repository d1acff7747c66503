"""One real server driven by the official `openai` client: the answers a vLLM user expects."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pdserve import SamplingParams
from servers import start_server, wait_idle


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    inst = start_server(tiny_model, tmp_path_factory.mktemp("server"), "--trust-request-chat-template")
    yield inst
    inst.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


PROMPT = "The prefill server sends the cache to the decode server"


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_equals_offline_api(client, llm_tp1):
    offline = llm_tp1.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].text == offline.text
    assert r.usage.prompt_tokens == len(llm_tp1.tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == len(offline.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == offline.finish_reason


def test_streaming_completion_with_usage(client, llm_tp1):
    offline = llm_tp1.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline.text
    assert chunks[-1].usage.completion_tokens == len(offline.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_equals_non_streaming(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert full.usage.completion_tokens == 16


def test_completion_logprobs(client, llm_tp1):
    offline = llm_tp1.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for ours, entry, top in zip(offline.outputs[0].logprobs, lp.token_logprobs, lp.top_logprobs):
        assert entry == pytest.approx(ours.logprob, abs=1e-5)
        assert len(top) == 3 and max(top.values()) == pytest.approx(ours.top[0][1], abs=1e-5)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_n_and_seed(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                  seed=5, n=3)
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                      seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 36


def test_stop_string(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = text[8:11]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_requests(server, llm_tp1):
    prompts = [f"request number {i} asks about {'cache ' * (i % 5)}blocks" for i in range(16)]
    expected = [o.outputs[0].text for o in
                llm_tp1.generate(prompts, SamplingParams(temperature=0, max_tokens=16))]

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        tasks = [c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
                 for p in prompts]
        return [r.choices[0].text for r in await asyncio.gather(*tasks)]
    assert asyncio.run(run()) == expected
    wait_idle(server)


def test_request_id_is_echoed_and_logged(server, client):
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="hello", max_tokens=2, extra_headers={"X-Request-Id": "my-trace-42"})
    assert raw.headers["x-request-id"] == "my-trace-42"
    assert raw.parse().id == "cmpl-my-trace-42"
    assert "[my-trace-42]" in server.log_path.read_text()


def test_cancelled_stream_frees_its_blocks(server):
    import httpx
    idle = wait_idle(server)["num_free_blocks"]
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
                            "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break  # the client goes away mid-stream
    assert wait_idle(server)["num_free_blocks"] == idle


def test_chat_template_fields_of_the_request(client, server, llm_tp1):
    """vLLM's request fields: chat_template, chat_template_kwargs, continue_final_message."""
    from servers import post_json
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The cache"}]
    template = ("{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
                "{% if add_generation_prompt %}{{ tail }}{% endif %}")
    tok = llm_tp1.tokenizer

    def offline(text: str) -> str:
        ids = tok.encode(text, add_special_tokens=False)
        return llm_tp1.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"chat_template": template,
                                                   "chat_template_kwargs": {"tail": "go:"}})
    text = tok.apply_chat_template(messages, True, chat_template=template, template_kwargs={"tail": "go:"})
    assert text.endswith(";go:") and r.choices[0].message.content == offline(text)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True,
                                                   "add_generation_prompt": False})
    text = tok.apply_chat_template(messages, False, continue_final_message=True)
    assert text.endswith("The cache") and r.choices[0].message.content == offline(text)
    code, body = post_json(server.url + "/v1/chat/completions",
                           {"messages": messages, "chat_template": "{% for %}"})
    assert code == 400 and body["error"]["param"] == "chat_template", body
    code, body = post_json(server.url + "/v1/chat/completions",
                           {"messages": messages, "continue_final_message": True})
    assert code == 400 and "cannot both" in body["error"]["message"], body
