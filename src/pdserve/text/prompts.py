"""A request's prompt as token ids, by the same rules in every process that needs them: the server
(which computes it) and the proxy (which routes by the blocks it fills).

Any process. Plain JSON values in; errors name the request field (`PromptError.field`).
"""

from __future__ import annotations

import json

from pdserve.text.tokenizer import Tokenizer


class PromptError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def message_text(content, index: int) -> str:
    """A chat message's content: a string, or text parts joined (other parts are refused)."""
    if not isinstance(content, list):
        return content or ""
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise PromptError(f"messages.{index}.content", "only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def chat_messages(messages: list) -> list[dict]:
    """What the chat template sees of each message: its role and its text, and the tool fields of
    OpenAI's messages (an assistant's `tool_calls`, with `arguments` parsed as vLLM hands them to
    templates; a tool result's `tool_call_id` and `name`)."""
    out = []
    for i, m in enumerate(messages):
        msg = {"role": m["role"], "content": message_text(m.get("content"), i)}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        out.append(msg)
    return out


def _template_call(call) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # left as the client wrote it
    return {**call, "function": fn}


def template_tools(functions: list[dict]) -> list[dict]:
    """What a chat template receives as `tools`: each function as {"type": "function", "function": ...},
    as vLLM hands OpenAI's function tools to templates (the instance's and the proxy's rendering)."""
    return [{"type": "function", "function": f} for f in functions]


def chat_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A rendered chat prompt's ids: the template already placed every special token."""
    return tokenizer.encode(text, add_special_tokens=False)


def text_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A completion prompt's ids (with the tokenizer's own BOS, as vLLM's)."""
    return tokenizer.encode(text, add_special_tokens=True)
