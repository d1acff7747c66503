"""Tool calls read as they are written: each call's name once it is known, then its arguments in
pieces, as vLLM and OpenAI stream them.

Server process, pure. `CallScanner` reads JSON call objects (`{"name": ..., "arguments": {...}}`,
or `parameters`: the first of the two given) alone, in lists, joined by `;`, or each in a block
between markers (hermes' `<tool_call>` ... `</tool_call>`: text outside the blocks is never read as
a call, and a block's end ends its call), character by character, keeping its place between feeds.
An object's arguments are passed on as they arrive, as the model wrote them; arguments written as a
JSON string (some models do) are passed on once complete, decoded. What is passed on stays passed
on: a call that turns out malformed later (cut by max_tokens, text after it that the whole answer's
parse rejects) keeps its pieces, as in vLLM's streams.
"""

from __future__ import annotations

import dataclasses
import json

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclasses.dataclass(frozen=True)
class CallDelta:
    """A piece of call `index`: its first piece carries the name."""

    index: int
    arguments: str
    name: str | None = None


class CallScanner:
    """Feed the text of the calls so far (it only grows); get the pieces new since the last feed.
    `block`: the (start, end) markers of a format that puts each call in a block; `start` is then
    where the first block's content begins."""

    def __init__(self, start: int = 0, block: tuple[str, str] | None = None):
        self.pos = start  # next character to read
        self.num_calls = 0  # calls whose name was passed on
        self._call: _Call | None = None
        self.block = block
        self.in_block = True  # reading a block's content (always, without blocks)

    def feed(self, text: str) -> list[CallDelta]:
        out: list[CallDelta] = []
        while self.pos < len(text):
            if self.block is not None:
                marker = self.block[1] if self.in_block else self.block[0]
                if text.startswith(marker, self.pos):  # a block begins, or ends (and its call with it)
                    if self._call is not None:
                        out += self._pieces(text, done=False)
                        self._call = None
                    self.pos += len(marker)
                    self.in_block = not self.in_block
                    continue
                if len(text) - self.pos < len(marker) and marker.startswith(text[self.pos:]):
                    break  # perhaps the marker: wait for the rest
                if not self.in_block:
                    self.pos += 1
                    continue
            ch = text[self.pos]
            self.pos += 1
            if self._call is not None:
                if self._call.read(text, self.pos - 1):
                    out += self._pieces(text, done=True)
                    self._call = None
            elif ch == "{":
                self._call = _Call()
        if self._call is not None:
            out += self._pieces(text, done=False)
        return out

    def _pieces(self, text: str, done: bool) -> list[CallDelta]:
        call = self._call
        if call.name is None:  # not known yet, or not a call
            return []
        out = []
        if call.index is None:
            call.index = self.num_calls
            self.num_calls += 1
            out.append(CallDelta(call.index, "", call.name))
        piece = call.arguments(text, self.pos, done)
        if piece:
            out.append(CallDelta(call.index, piece))
        return out


class _Call:
    """One call object being read: its JSON structure, the keys directly inside it, and the two
    values that matter (`name`, and `arguments` or `parameters`)."""

    def __init__(self):
        self.depth = 1  # brackets open, the call's own included: 1 directly inside it
        self.in_string = self.escaped = False
        self.phase = "key"  # at depth 1: "key", "colon" (after a key), "value"
        self.key: str | None = None
        self.token_start: int | None = None  # where the key or value being read began
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_raw = True  # an object or list: passed on as written; else once complete, decoded
        self.reading_args = False  # the value being read is the arguments
        self.num_args_sent = 0  # characters of the arguments passed on
        self.index: int | None = None

    def read(self, text: str, pos: int) -> bool:
        """Read text[pos]; True once the call object closes."""
        ch = text[pos]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.phase == "key":
                    self.key, self.phase = _loads(text[self.token_start:pos + 1]), "colon"
            return False
        if self.depth == 1:
            if self.phase == "key" and ch == '"':
                self.token_start = pos
            elif self.phase == "colon" and ch == ":":
                self.phase, self.token_start = "value", None
            elif self.phase == "value" and self.token_start is None and not ch.isspace() and ch not in ",}":
                self.token_start = pos
                if self.key in ARGUMENT_KEYS and self.args_start is None:  # the first given
                    self.args_start, self.args_raw, self.reading_args = pos, ch in "{[", True
            elif ch in ",}":
                self._value_ends(text, pos)
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.reading_args:
                self.args_end = pos + 1
        return self.depth == 0

    def _value_ends(self, text: str, pos: int) -> None:
        """A `,` or the call's `}` at depth 1: the value being read, if any, ends before pos."""
        if self.phase == "value" and self.token_start is not None:
            value = text[self.token_start:pos].strip()
            if self.key == "name":
                name = _loads(value)
                self.name = name if isinstance(name, str) else None
            elif self.reading_args and self.args_end is None:
                self.args_end = self.token_start + len(value)
        self.phase, self.key, self.token_start, self.reading_args = "key", None, None, False

    def arguments(self, text: str, pos: int, done: bool) -> str:
        """The arguments' characters not yet passed on, of those read before pos."""
        if self.args_start is None:  # none given: an empty object, as the whole answer's parse says
            if done and not self.num_args_sent:
                self.num_args_sent = 2
                return "{}"
            return ""
        if not self.args_raw:
            if self.args_end is None or self.num_args_sent:
                return ""
            self.num_args_sent = 1
            return _decoded(text[self.args_start:self.args_end])
        end = self.args_end if self.args_end is not None else pos
        piece = text[self.args_start + self.num_args_sent:end]
        self.num_args_sent += len(piece)
        return piece


def _loads(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return None


def _decoded(value: str) -> str:
    """Arguments written as a JSON string: the object it holds, as text."""
    try:
        inner = json.loads(value)
        return json.dumps(json.loads(inner) if isinstance(inner, str) else inner, ensure_ascii=False)
    except ValueError:
        return value
