"""Tool calls in a model's text, as vLLM's `--tool-call-parser` reads them: hermes (Qwen's
`<tool_call>{...}</tool_call>`), llama3_json (`{"name": ..., "parameters": {...}}`, several joined by
`;`) and mistral (`[TOOL_CALLS][{...}, ...]`).

Server process. Pure functions of the text: `parse` reads a whole answer; `StreamingToolParser`
reads deltas, passing on content until a call may start, then each call's name and its arguments
in pieces as they are written (text/tool_stream.py). A call that does not parse, of which nothing
was passed on, stays content, as vLLM leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import re

from pdserve.text.tool_stream import CallDelta, CallScanner


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclasses.dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[ToolCall]


def _call(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_calls(text: str) -> list[ToolCall] | None:
    """One JSON value or several joined by `;`: each a call (a list: its items), else None."""
    decoder, calls, pos, text = json.JSONDecoder(), [], 0, text.strip()
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        for obj in value if isinstance(value, list) else [value]:
            call = _call(obj)
            if call is None:
                return None
            calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \n\t;,":
            pos += 1
    return calls or None


class Hermes:
    start = "<tool_call>"
    block = (start, "</tool_call>")  # each call in a block of its own
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> Parsed:
        if self.start not in text:
            return Parsed(text, [])
        calls = []
        for body in self._block.findall(text):
            found = json_calls(body)
            if found is None:
                return Parsed(text, [])
            calls += found
        content = text[:text.index(self.start)]
        return Parsed(content or None, calls)


class Llama3Json:
    start = "{"  # a call is the whole answer: it starts at its first character, or after the tag
    tag = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.lstrip()
        body = body[len(self.tag):] if body.startswith(self.tag) else body  # as vLLM's: only at the start
        if not body.lstrip().startswith(("{", "[")):
            return Parsed(text, [])
        calls = json_calls(body)
        return Parsed(None, calls) if calls else Parsed(text, [])


class Mistral:
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> Parsed:
        if self.start not in text:
            return Parsed(text, [])
        content, body = text.split(self.start, 1)
        calls = json_calls(body)
        return Parsed(content or None, calls) if calls else Parsed(text, [])


PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}


def get_parser(name: str):
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; pdserve has {', '.join(PARSERS)}")
    return PARSERS[name]()


class StreamingToolParser:
    """Deltas in, (content delta, call pieces) out. Text that may be the start of a call is held
    back; once a call starts, its name is passed on when known and its arguments as they arrive.
    At the end the whole answer is parsed: calls the pieces missed are passed on whole, and text
    that held no call after all is passed on as content."""

    def __init__(self, parser):
        self.parser = parser
        self.text = ""
        self.num_content_chars = 0  # content passed on so far
        self.scanner: CallScanner | None = None  # once a call may have started

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.text += delta
        out = ""
        if self.scanner is None:
            at = self._call_start()
            if at is None:
                keep = 0 if final else self._undecided()
                return self._content(len(self.text) - keep), []
            if isinstance(self.parser, Llama3Json):  # its leading blanks are nothing (content again if no call)
                body = at
            else:  # the content before the marker, and the calls after it
                out, body = self._content(at), at + len(self.parser.start)
            self.scanner = CallScanner(body, getattr(self.parser, "block", None))
        pieces = self.scanner.feed(self.text)
        if not final:
            return out, pieces
        streamed = self.scanner.num_calls
        calls = self.parser.parse(self.text).calls
        if not calls and not streamed:  # not a call after all: it was content
            return out + self._content(len(self.text)), []
        for index, call in enumerate(calls[streamed:], streamed):
            pieces += [CallDelta(index, "", call.name), CallDelta(index, call.arguments)]
        return out, pieces

    def _call_start(self) -> int | None:
        if isinstance(self.parser, Llama3Json):  # a call is the whole answer
            stripped = self.text.lstrip()
            if stripped[:1] in ("{", "[") or stripped.startswith(Llama3Json.tag):
                return len(self.text) - len(stripped)
            return None
        at = self.text.find(self.parser.start)
        return None if at < 0 else at

    def _undecided(self) -> int:
        """How many characters at the end may still begin a call: held back until that is known."""
        if isinstance(self.parser, Llama3Json):  # blanks, or the start of the tag, from the beginning
            stripped = self.text.lstrip()
            return len(self.text) if Llama3Json.tag.startswith(stripped) else 0
        return _partial_suffix(self.text, self.parser.start)

    def _content(self, upto: int) -> str:
        out = self.text[self.num_content_chars:upto]
        self.num_content_chars = max(self.num_content_chars, upto)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
