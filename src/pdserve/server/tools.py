"""Tool calling as vLLM serves it: `tools`, `tool_choice` (none, auto, required, a named function).

Server process, chat only. `required` and a named function are forced through the grammar (a JSON
schema built from the tools, as vLLM builds it); `auto` reads the model's own format with the
server's `--tool-call-parser` (text/tool_parsers.py). Calls come back as `tool_calls` in the message
(`finish_reason: "tool_calls"`); streamed, as OpenAI and vLLM stream them: a call's first delta
carries its id and name, the ones after it pieces of its arguments as the model writes them.
"""

from __future__ import annotations

import json
import uuid

from pdserve.sampling_params import InvalidRequestError, StructuredOutputs
from pdserve.server.structured import json_schema, structured_outputs
from pdserve.text.prompts import template_tools
from pdserve.text.tool_parsers import Parsed, StreamingToolParser, ToolCall, json_calls, get_parser
from pdserve.text.tool_stream import CallDelta, CallScanner


class ToolPolicy:
    """The server's part: `--enable-auto-tool-choice --tool-call-parser NAME`."""

    def __init__(self, enable_auto: bool = False, parser: str | None = None):
        if enable_auto and parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.parser_name = parser if enable_auto else None
        if parser is not None:
            get_parser(parser)  # an unknown name fails at startup


class ToolRequest:
    """One chat request's tools: the schema that forces them, and how its answer is read."""

    def __init__(self, req, policy: ToolPolicy):
        self.tools = [_function(t, i) for i, t in enumerate(req.tools or [])]
        self.parallel = req.parallel_tool_calls is not False
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if self.tools else "none")
        self.mode, self.named = _mode(choice, self.tools)
        if self.mode == "auto" and self.tools and policy.parser_name is None:
            raise InvalidRequestError("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice '
                                                     'and --tool-call-parser to be set')
        if self.mode in ("required", "named") and structured_outputs(req) is not None:
            raise InvalidRequestError("tool_choice", f"{self.mode} tool choice cannot be combined with "
                                                     f"a structured-output constraint")
        self.parser = get_parser(policy.parser_name) if self.mode == "auto" and self.tools else None

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template receives as `tools` (none when tool_choice is none)."""
        if not self.tools or self.mode == "none":
            return None
        return template_tools(self.tools)

    def constraint(self) -> StructuredOutputs | None:
        if self.mode == "named":
            return json_schema(self.named.get("parameters") or {"type": "object"}, "tool_choice")
        if self.mode == "required":
            return json_schema(_required_schema(self.tools, self.parallel), "tools")
        return None

    def answer(self, text: str) -> tuple[str | None, list[dict] | None]:
        """A whole answer's (content, tool_calls)."""
        parsed = self._parse(text)
        if not parsed.calls:
            return parsed.content, None
        return parsed.content, [_tool_call(c) for c in parsed.calls]

    def stream(self):
        return _Stream(self)

    def _parse(self, text: str) -> Parsed:
        if self.mode == "named":
            return Parsed(None, [ToolCall(self.named["name"], text)])
        if self.mode == "required":
            return Parsed(None, json_calls(text) or []) if text.strip() else Parsed(text, [])
        if self.parser is not None:
            return self.parser.parse(text)
        return Parsed(text, [])


class _Stream:
    """Deltas of one choice: (content delta, tool_calls delta entries) per model delta."""

    def __init__(self, tools: ToolRequest):
        self.tools = tools
        self.text = ""
        self.ids: dict[int, str] = {}  # calls begun: index -> id
        self.scanner = CallScanner() if tools.mode == "required" else None  # the grammar's array
        self.parser = StreamingToolParser(tools.parser) if tools.parser is not None else None

    def feed(self, delta: str, final: bool) -> tuple[str | None, list[dict] | None]:
        if self.tools.mode == "named":  # the grammar's JSON is the arguments, from the first token
            head = [] if self.ids else [CallDelta(0, "", self.tools.named["name"])]
            return None, self._entries(head + [CallDelta(0, delta)])
        if self.scanner is not None:
            self.text += delta
            return None, self._entries(self.scanner.feed(self.text))
        if self.parser is None:
            return delta, None
        content, pieces = self.parser.feed(delta, final)
        return content or None, self._entries(pieces)

    def _entries(self, pieces: list[CallDelta]) -> list[dict] | None:
        """OpenAI's delta entries; pieces of one call in a row are joined into one entry."""
        out: list[dict] = []
        for p in pieces:
            if out and out[-1]["index"] == p.index:
                out[-1]["function"]["arguments"] += p.arguments
            elif p.name is not None:
                self.ids[p.index] = f"chatcmpl-tool-{uuid.uuid4().hex}"
                out.append({"index": p.index, "id": self.ids[p.index], "type": "function",
                            "function": {"name": p.name, "arguments": p.arguments}})
            elif p.arguments:
                out.append({"index": p.index, "function": {"arguments": p.arguments}})
        return out or None

    @property
    def called(self) -> bool:
        return bool(self.ids)


def _function(tool, index: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"tools[{index}]", 'must be {"type": "function", "function": {"name": ..., '
                                                     '"parameters": {...}}}')
    params = fn.get("parameters")
    if params is not None:
        json_schema(params, f"tools[{index}].function.parameters")
    return fn


def _mode(choice, tools: list[dict]) -> tuple[str, dict | None]:
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice", '"required" needs tools')
        return choice, None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = next((t for t in tools if t["name"] == name), None)
        if named is None:
            raise InvalidRequestError("tool_choice", f"names the function {name!r}, which is not in tools")
        return "named", named
    raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                                             '{"type": "function", "function": {"name": ...}}')


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's: a non-empty array of {name, parameters}, each a tool's name and its parameters, the
    tools' `$defs` lifted to the top; nothing else in an item (vLLM leaves that open). With
    `parallel_tool_calls: false` (OpenAI's), one item."""
    defs, items = {}, []
    for t in tools:
        params = dict(t.get("parameters") or {"type": "object"})
        defs.update(params.pop("$defs", {}))
        items.append({"properties": {"name": {"type": "string", "enum": [t["name"]]}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _tool_call(call: ToolCall) -> dict:
    args = call.arguments
    try:
        args = json.dumps(json.loads(args), ensure_ascii=False)
    except ValueError:
        pass  # a truncated answer (max_tokens): its text as it is
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": call.name, "arguments": args}}
