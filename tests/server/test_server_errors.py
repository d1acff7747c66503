"""Every malformed request gets the right status and a message naming the field; nothing leaks and
the next valid request is answered correctly."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from servers import post_json, start_server, wait_idle


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    inst = start_server(tiny_model, tmp_path_factory.mktemp("errors"))
    yield inst
    inst.stop()


CASES = [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 10 ** 7]}, 400, "prompt"),
    ({"prompt": "word " * 3000}, 400, "prompt"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "kv_transfer_params": "yes"}, 400, "kv_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_decode": "true"}}, 400,
     "kv_transfer_params.do_remote_decode"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}, 400,
     "kv_transfer_params.remote_engine_id"),
    ({"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, 400, "n"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "presence_penalty": 3.0}, 400, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"1000000": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "allowed_token_ids": [1, 10 ** 7]}, 400, "allowed_token_ids"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
]


@pytest.mark.parametrize("body, status, field", CASES, ids=[c[2] + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_completion_request(server, body, status, field):
    code, resp = post_json(server.url + "/v1/completions", body)
    assert code == status, resp
    err = resp["error"]
    assert err["code"] == status and err["param"] == field and field.split(".")[-1] in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_bad_chat_requests(server):
    for body, field in [({"messages": []}, "messages"),
                        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")]:
        code, resp = post_json(server.url + "/v1/chat/completions", body)
        assert code == 400 and resp["error"]["param"] == field, resp


def test_token_id_zero_is_a_valid_prompt_token(server):
    code, resp = post_json(server.url + "/v1/completions", {"prompt": [0, 5, 7], "max_tokens": 2})
    assert code == 200, resp


def test_invalid_json(server):
    req = urllib.request.Request(server.url + "/v1/completions", b"{not json",
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and b"not valid JSON" in e.value.read()


def test_still_serving_and_nothing_leaked(server):
    idle = wait_idle(server)
    assert idle["num_free_blocks"] == idle["num_blocks"]
    code, resp = post_json(server.url + "/v1/completions",
                           {"prompt": "still fine", "max_tokens": 3, "temperature": 0})
    assert code == 200 and resp["usage"]["completion_tokens"] == 3


def test_api_key(tiny_model, tmp_path):
    inst = start_server(tiny_model, tmp_path, env={"PDSERVE_API_KEY": "sekret"}, num_blocks=32)
    try:
        code, resp = post_json(inst.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert code == 401 and resp["error"]["type"] == "AuthenticationError"
        # refused before its body is read: a client that uploads it all first still reads the 401
        code, resp = post_json(inst.url + "/v1/completions", {"prompt": "x" * (6 << 20), "max_tokens": 1})
        assert code == 401 and resp["error"]["type"] == "AuthenticationError"
        code, _ = post_json(inst.url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                            headers={"Authorization": "Bearer wrong"})
        assert code == 401
        code, _ = post_json(inst.url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                            headers={"Authorization": "Bearer sekret"})
        assert code == 200
        with urllib.request.urlopen(inst.url + "/health", timeout=5) as r:  # health needs no key
            assert r.status == 200
    finally:
        inst.stop()


# --- chat templates: the request's template and kwargs (docs/design.md, "Checkpoints and chat") ---

SERVER_TEMPLATE = ("{% for t in tools %}[{{ t['name'] }}]{% endfor %}{% for m in messages %}<|{{ m['role'] }}|>"
                   "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "user", "content": "hello"}]
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def trusted(tiny_model, tmp_path_factory):
    """An instance that renders request templates, with a server template that takes `tools`."""
    log_dir = tmp_path_factory.mktemp("trusted")
    (log_dir / "template.jinja").write_text(SERVER_TEMPLATE)
    inst = start_server(tiny_model, log_dir, "--chat-template", str(log_dir / "template.jinja"),
                        "--trust-request-chat-template", "--max-request-body-bytes", str(BODY_LIMIT),
                        num_blocks=32)
    yield inst
    inst.stop()


def test_a_template_error_caused_by_the_request_is_a_400_naming_the_field(trusted):
    for extra, field in [({"chat_template": "{{ 1/0 }}"}, "chat_template"),
                         ({"chat_template": "{{ messages.pop() }}"}, "chat_template"),
                         ({"chat_template_kwargs": {"tools": 5}}, "chat_template_kwargs")]:
        code, resp = post_json(trusted.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                                      **extra})
        assert code == 400 and resp["error"]["param"] == field, (extra, resp)
        assert set(resp["error"]) == {"message", "type", "param", "code"}
    code, resp = post_json(trusted.url + "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"tools": [{"name": "f"}]}})
    assert code == 200 and resp["usage"]["completion_tokens"] == 2, resp


def test_a_request_template_is_refused_unless_the_server_trusts_them(server):
    code, resp = post_json(server.url + "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 1, "chat_template": "{{ messages }}"})
    assert code == 400 and resp["error"]["param"] == "chat_template", resp
    assert "--trust-request-chat-template" in resp["error"]["message"]


def test_special_tokens_in_kwargs_must_be_strings(server):
    code, resp = post_json(server.url + "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"bos_token": {"a": 1}}})
    assert code == 400 and resp["error"]["param"] == "chat_template_kwargs.bos_token", resp


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # hours
    "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",  # 10 GB of prompt
    "{{ 'x' * 4000000000 }}",  # 4 GB at once
], ids=["time", "output", "memory"])
def test_a_trusted_request_template_is_bounded(trusted, template):
    start = time.monotonic()
    code, resp = post_json(trusted.url + "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 1, "chat_template": template}, timeout=30)
    assert code == 400 and resp["error"]["param"] == "chat_template", resp
    assert time.monotonic() - start < 10
    code, resp = post_json(trusted.url + "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }}"})
    assert code == 200 and resp["usage"]["completion_tokens"] == 2, resp


# --- a body over --max-request-body-bytes: a 413 that clients which upload first can read --------

def _oversized(n: int, chunked: bool):
    body = b'{"prompt": "' + b"a" * n + b'"}'
    return (body[i:i + (1 << 16)] for i in range(0, len(body), 1 << 16)) if chunked else body


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("times", [2, 24])
def test_an_oversized_body_gets_a_413_that_python_clients_read(trusted, chunked, times):
    """urllib and httpx send the whole body before they read: the server must read it (up to a
    bound) before it answers, or the client gets a connection reset instead of the 413."""
    import httpx
    url = trusted.url + "/v1/completions"
    req = urllib.request.Request(url, _oversized(times * BODY_LIMIT, chunked), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413
    assert json.loads(e.value.read())["error"]["param"] == "body"
    with httpx.Client(timeout=30) as client:
        r = client.post(url, content=_oversized(times * BODY_LIMIT, chunked),
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError", r.text[:200]
        r = client.post(url, json={"prompt": "still fine", "max_tokens": 2})  # the same client goes on
        assert r.status_code == 200, r.text[:200]
