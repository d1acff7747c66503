"""Tool-call parsers on fixed strings, whole and streamed in pieces (vLLM's output formats)."""

from __future__ import annotations

import json

import pytest

from pdserve.text.tool_parsers import StreamingToolParser, ToolCall, get_parser

W = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"}))
T = ToolCall("get_time", json.dumps({"tz": "UTC"}))
CASES = {
    "hermes": ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
               "Let me look."),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
                    '{"name": "get_time", "parameters": {"tz": "UTC"}}', None),
    "mistral": ('Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
                '{"name": "get_time", "arguments": {"tz": "UTC"}}]', "Sure"),
}


@pytest.mark.parametrize("name", CASES)
def test_whole_answer(name):
    text, content = CASES[name]
    parsed = get_parser(name).parse(text)
    assert parsed.calls == [W, T]
    assert parsed.content == content


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_in_pieces_equals_whole(name, piece):
    text, content = CASES[name]
    stream = StreamingToolParser(get_parser(name))
    got_content, calls = "", []
    for i in range(0, len(text), piece):
        c, new = stream.feed(text[i:i + piece])
        got_content += c
        calls += new
    c, new = stream.feed("", final=True)
    assert calls + new == [W, T]
    assert got_content + c == (content or "")


@pytest.mark.parametrize("name", CASES)
def test_plain_text_is_content(name):
    text = "No tools needed: it is sunny [TOOL or <tool"
    assert get_parser(name).parse(text).content == text
    stream = StreamingToolParser(get_parser(name))
    out = "".join(stream.feed(text[i:i + 4])[0] for i in range(0, len(text), 4))
    assert out + stream.feed("", final=True)[0] == text


def test_a_call_that_does_not_parse_stays_content():
    text = "<tool_call>{not json</tool_call>"
    assert get_parser("hermes").parse(text).calls == []
    stream = StreamingToolParser(get_parser("hermes"))
    assert stream.feed(text) == ("", [])
    assert stream.feed("", final=True) == (text, [])


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")
