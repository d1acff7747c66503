"""Structured outputs and tool calls through real processes: one instance, and P/D through the proxy
(1P1D, TP 1). The generated model's random weights write garbage without a grammar, so an answer that
parses and validates proves the mask, on the producer's first token and on decode's."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdserve.launcher import Deployment
from servers import INSTANCE_ARGS, post_json

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "ok": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["tz"],
    "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}}}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON"}]


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    d = Deployment(tiny_model, [1], [1], log_dir=str(tmp_path_factory.mktemp("structured")),
                   instance_args=[*INSTANCE_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    d.start(timeout_s=120)
    yield d
    d.stop()


def clients(dep):
    """One instance alone, and P/D through the proxy."""
    return {name: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            for name, url in (("instance", dep.decode[0].url), ("pd", dep.proxy.url))}


def streamed_calls(chunks) -> tuple[list[dict], str]:
    """A stream's tool calls put together as OpenAI's clients do (by index: the first delta carries
    the id and name, the others pieces of the arguments), and its last finish reason."""
    calls, finish = {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        finish = ch.choices[0].finish_reason or finish
        for tc in ch.choices[0].delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": "", "pieces": 0}
            else:
                assert tc.id is None and tc.function.name is None  # named once, then arguments only
            calls[tc.index]["arguments"] += tc.function.arguments or ""
            calls[tc.index]["pieces"] += 1
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], finish


def test_json_schema_single_and_pd(dep):
    for name, client in clients(dep).items():
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop", name
        c = client.completions.create(model="tiny", prompt="person:", max_tokens=120, temperature=1.0, seed=3,
                                      extra_body={"guided_json": SCHEMA})
        jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)
        chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, stream=True,
                                                extra_body={"structured_outputs": {"json": SCHEMA}})
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_bad_schema_is_a_400_naming_the_field(dep):
    for client in clients(dep).values():
        with pytest.raises(openai.BadRequestError, match="guided_regex"):
            client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"guided_regex": "a(("})


def test_named_and_required_tool_choice(dep):
    for name, client in clients(dep).items():
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather", name
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, tools=[WEATHER, TIME],
                                           tool_choice="required", seed=1, temperature=1.0,
                                           parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", name
        for call in r.choices[0].message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        # streamed: the name first, then the arguments in pieces as the grammar lets the model write them
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, want in ((named, "stop"), ("required", "tool_calls")):
            calls, finish = streamed_calls(client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=120, tools=[WEATHER, TIME], tool_choice=choice,
                seed=1, temperature=1.0, parallel_tool_calls=False, stream=True))
            assert finish == want and calls, (name, choice)
            for call in calls:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
                jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
                assert call["pieces"] > 2, (name, choice, call)


def test_auto_reads_calls_with_the_parser(dep):
    """The model is made to write a hermes call (a regex) and tool_choice auto reads it, whole and streamed."""
    regex = r'Sure\.<tool_call>\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}</tool_call>'
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 80, "tools": [WEATHER, TIME],
            "tool_choice": "auto", "extra_body": {"guided_regex": regex}}
    for name, client in clients(dep).items():
        r = client.chat.completions.create(**body)
        assert r.choices[0].finish_reason == "tool_calls", name
        assert r.choices[0].message.content == "Sure."
        assert r.choices[0].message.tool_calls[0].function.name == "get_time"
        calls, finish = streamed_calls(client.chat.completions.create(**body, stream=True))
        assert [c["name"] for c in calls] == ["get_time"] and finish == "tool_calls"
        assert json.loads(calls[0]["arguments"])["tz"] in ("UTC", "CET")
        assert calls[0]["pieces"] > 2  # the arguments as they are written, not once the call is closed


def test_auto_without_a_parser_is_refused(dep, tiny_model):
    status, body = post_json(dep.proxy.url + "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "nope"}}})
    assert status == 400 and "tool_choice" in json.dumps(body)
