"""Tool calls in a model's text, as vLLM's `--tool-call-parser` reads them: hermes (Qwen's
`<tool_call>{...}</tool_call>`), llama3_json (`{"name": ..., "parameters": {...}}`, several joined by
`;`) and mistral (`[TOOL_CALLS][{...}, ...]`).

Server process. Pure functions of the text: `parse` reads a whole answer; `StreamingToolParser`
reads deltas, passing on content until a call may start and each call once it is complete. A
call that does not parse stays content, as vLLM leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import re


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
    start, end = "<tool_call>", "</tool_call>"
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
    start, end = "{", None
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.split(self._tag, 1)[1] if self._tag in text else text
        if not body.lstrip().startswith(("{", "[")):
            return Parsed(text, [])
        calls = json_calls(body)
        return Parsed(None, calls) if calls else Parsed(text, [])


class Mistral:
    start, end = "[TOOL_CALLS]", None

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
    """Deltas in, (content delta, calls completed since the last feed) out. Text that may be the
    start of a call is held back; a call is passed on when its block closes or the answer ends."""

    def __init__(self, parser):
        self.parser = parser
        self.text = ""
        self.num_content_chars = 0  # content passed on so far
        self.num_calls = 0
        self.in_calls = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        start = self.parser.start
        if not self.in_calls:
            at = self._call_start()
            if at is None:
                keep = 0 if final else _partial_suffix(self.text, start)
                return self._content(len(self.text) - keep), []
            self.in_calls = True
            out = self._content(at)
        else:
            out = ""
        closed = self.text if final else self._closed()
        if closed is None:
            return out, []
        parsed = self.parser.parse(closed)
        if not parsed.calls:
            if final:  # not a call after all: it was content
                self.in_calls = False
                return out + self._content(len(self.text)), []
            return out, []
        new = parsed.calls[self.num_calls:]
        self.num_calls = len(parsed.calls)
        return out, new

    def _call_start(self) -> int | None:
        start = self.parser.start
        if start == "{":  # llama3_json: a call is the whole answer
            stripped = self.text.lstrip()
            if not stripped:
                return None
            return len(self.text) - len(stripped) if stripped[0] in "{[<" else None
        at = self.text.find(start)
        return None if at < 0 else at

    def _closed(self) -> str | None:
        """The text up to the last complete call, where the format closes calls (hermes)."""
        end = self.parser.end
        if end is None or end not in self.text:
            return None
        return self.text[:self.text.rindex(end) + len(end)]

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
