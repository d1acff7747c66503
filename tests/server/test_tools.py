"""tool_choice without processes: the schema that forces a call, the answer read back, the errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.sampling_params import InvalidRequestError
from pdserve.server.protocol import ChatCompletionRequest
from pdserve.server.tools import ToolPolicy, ToolRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
HERMES = ToolPolicy(True, "hermes")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_named_forces_the_parameters_schema():
    tools = ToolRequest(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}}), HERMES)
    assert json.loads(tools.constraint().value) == WEATHER["function"]["parameters"]
    content, calls = tools.answer('{"city": "Paris"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_required_forces_an_array_of_calls():
    tools = ToolRequest(request(tools=[WEATHER, TIME], tool_choice="required"), ToolPolicy())
    schema = json.loads(tools.constraint().value)
    answer = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(answer, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    _, calls = tools.answer(json.dumps(answer))
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    one = ToolRequest(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), ToolPolicy())
    assert json.loads(one.constraint().value)["maxItems"] == 1


def test_auto_reads_the_parsers_format_and_none_passes_no_tools():
    tools = ToolRequest(request(tools=[WEATHER]), HERMES)
    assert tools.mode == "auto" and tools.constraint() is None
    assert tools.template_tools == [WEATHER]
    content, calls = tools.answer('ok<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert content == "ok" and calls[0]["function"]["name"] == "get_weather"
    none = ToolRequest(request(tools=[WEATHER], tool_choice="none"), HERMES)
    assert none.template_tools is None and none.answer("<tool_call>{}") == ("<tool_call>{}", None)


@pytest.mark.parametrize("fields,policy,field", [
    ({"tools": [WEATHER]}, ToolPolicy(), "tool_choice"),  # auto needs --enable-auto-tool-choice
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, HERMES, "tool_choice"),
    ({"tool_choice": "required"}, HERMES, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, HERMES, "tool_choice"),
    ({"tools": [{"type": "function"}]}, HERMES, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, HERMES,
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, HERMES, "tool_choice"),
])
def test_errors_name_the_field(fields, policy, field):
    with pytest.raises(InvalidRequestError) as e:
        ToolRequest(request(**fields), policy)
    assert e.value.field == field


def test_policy_needs_a_known_parser():
    with pytest.raises(ValueError):
        ToolPolicy(True, None)
    with pytest.raises(ValueError):
        ToolPolicy(True, "nope")


def test_templates_receive_tools_and_tool_history(tiny_model):
    from pdserve.text.prompts import chat_messages
    from pdserve.text.tokenizer import Tokenizer
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}"
                "{% endfor %}{{ m.tool_call_id or '' }}|{% endfor %}")
    tok = Tokenizer(tiny_model, template)
    history = chat_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}])
    tools = ToolRequest(request(tools=[WEATHER]), HERMES).template_tools
    text = tok.apply_chat_template(history, False, tools=tools)
    assert text == "[get_weather]user:weather?|assistant:Oslo|tool:rainc1|"
