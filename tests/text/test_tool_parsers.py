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


def streamed(stream: StreamingToolParser, text: str, piece: int) -> tuple[str, dict[int, list]]:
    """Feed text in pieces; the content and, per call index, [name, arguments, argument pieces]."""
    content, calls = "", {}
    for i in range(0, len(text) + 1, piece):
        c, deltas = stream.feed(text[i:i + piece], final=i + piece > len(text))
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.index == len(calls) and d.arguments == ""  # the name comes first, alone
                calls[d.index] = [d.name, "", 0]
            else:
                calls[d.index][1] += d.arguments
                calls[d.index][2] += 1
    return content, calls


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_in_pieces_equals_whole(name, piece):
    text, content = CASES[name]
    got_content, calls = streamed(StreamingToolParser(get_parser(name)), text, piece)
    assert [ToolCall(n, json.dumps(json.loads(a))) for n, a, _ in calls.values()] == [W, T]
    assert got_content == (content or "")
    if piece < 7:  # the arguments arrive as they are written, not once the call is complete
        assert all(num_pieces > 3 for _, _, num_pieces in calls.values())


def test_arguments_written_as_a_string_or_missing():
    text = '{"name": "f", "arguments": "{\\"x\\": [1, \\"}\\"]}"}; {"name": "g"}'
    whole = get_parser("llama3_json").parse(text).calls
    assert whole == [ToolCall("f", '{"x": [1, "}"]}'), ToolCall("g", "{}")]
    _, calls = streamed(StreamingToolParser(get_parser("llama3_json")), text, 2)
    assert [ToolCall(n, a) for n, a, _ in calls.values()] == whole


def test_a_truncated_call_keeps_what_was_streamed():
    """max_tokens cut the call: its name and the arguments written so far were passed on (vLLM's
    behaviour too); nothing is passed on again as content."""
    text = 'Hm.<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = streamed(StreamingToolParser(get_parser("hermes")), text, 5)
    assert content == "Hm."
    assert [(n, a) for n, a, _ in calls.values()] == [("get_weather", '{"city": "Par')]


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
    assert stream.feed(text) == ("", [])  # held back: it may still be a call
    assert stream.feed("", final=True) == (text, [])


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_hermes_calls_are_read_only_inside_their_blocks(piece):
    """Found by review: JSON after a block is text, not a call; a block's end ends its call even when
    the JSON in it never closed; and of `arguments` and `parameters`, the first given counts."""
    text = ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"b": 2}, "parameters": {"c": 33333}}</tool_call>'
            ' I called {"name": "h", "arguments": {"x": 1}} ok')
    _, calls = streamed(StreamingToolParser(get_parser("hermes")), text, piece)
    assert [(n, a) for n, a, _ in calls.values()] == [("f", '{"a": 1'), ("g", '{"b": 2}')]


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize("text, content, calls", [
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ('  \n{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),  # blanks before a call are nothing
    ('pre <|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, []),  # vLLM's: the tag only at the start
    ("<b>bold</b> text", None, []),
    ('  {"not": "a call"}', None, []),  # its blanks too stay content
])
def test_llama3_json_streamed_equals_whole(text, content, calls, piece):
    whole = get_parser("llama3_json").parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    got_content, got = streamed(StreamingToolParser(get_parser("llama3_json")), text, piece)
    assert [(n, json.loads(a)) for n, a, _ in got.values()] == calls
    assert got_content == (text if content is None else content) == (whole.content or "")


def test_text_that_cannot_become_a_llama3_call_is_not_held_back():
    stream = StreamingToolParser(get_parser("llama3_json"))
    assert stream.feed("<b") == ("<b", [])  # not the tag's start: content at once
    stream = StreamingToolParser(get_parser("llama3_json"))
    assert stream.feed(" <|pyth") == ("", [])  # may still be the tag
