"""Every field of vLLM's and OpenAI's request schemas is used or, set to anything that would change
the answer, refused with a 400 naming it; fields of neither schema (a router's own) are ignored
with one warning per name. Parsing only: no engine."""

from __future__ import annotations

import logging

import pytest

from pdserve.sampling_params import InvalidRequestError
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.server.serving import BaseServing

MESSAGES = [{"role": "user", "content": "x"}]


def params(body: dict, chat: bool = False):
    req = ChatCompletionRequest(messages=MESSAGES, **body) if chat else CompletionRequest(prompt="x", **body)
    return BaseServing(None, "m", None).sampling_params(req, req.max_tokens, None)


def test_every_sampling_control_reaches_the_sampling_params():
    p = params({"logit_bias": {"5": 3.0, "7": -200}, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "allowed_token_ids": [5, 7, 9],
                "bad_words": ["foo"], "stop_token_ids": [3]})
    assert p.logit_bias == ((5, 3.0), (7, -100.0))  # clamped to OpenAI's [-100, 100]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_p, p.min_tokens, p.allowed_token_ids, p.bad_words) == (0.1, 2, (5, 7, 9), ("foo",))
    assert p.stop_token_ids == (3,)
    assert params({"bad_words": ["foo"]}, chat=True).bad_words == ("foo",)


@pytest.mark.parametrize("body, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
])
def test_out_of_range_controls_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as e:
        params(body)
    assert e.value.field == field


REFUSED = [("use_beam_search", True), ("length_penalty", 0.5), ("spaces_between_special_tokens", False),
           ("priority", 1), ("logits_processors", ["m.P"]),
           ("return_tokens_as_token_ids", True), ("vllm_xargs", {"a": 1}), ("mm_processor_kwargs", {"a": 1}),
           ("store", True), ("service_tier", "flex")]
COMPLETION_ONLY = [("best_of", 3), ("prompt_embeds", "AAAA"), ("add_special_tokens", False)]
CHAT_ONLY = [("add_special_tokens", True), ("documents", [{"text": "d"}]), ("reasoning_effort", "low"),
             ("include_reasoning", False), ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]),
             ("prediction", {"type": "content"}), ("web_search_options", {}), ("functions", [{"name": "f"}]),
             ("function_call", "auto"), ("verbosity", "high"), ("echo", True)]


@pytest.mark.parametrize("chat, field, value", [(False, f, v) for f, v in REFUSED + COMPLETION_ONLY]
                         + [(True, f, v) for f, v in REFUSED + CHAT_ONLY])
def test_an_unimplemented_field_is_refused_naming_it_unless_neutral(chat, field, value):
    with pytest.raises(InvalidRequestError) as e:
        params({field: value}, chat)
    assert e.value.field == field and "not supported" in str(e.value)


def test_neutral_values_of_unimplemented_fields_pass():
    neutral = {"use_beam_search": False, "length_penalty": 1, "spaces_between_special_tokens": True,
               "priority": 0, "logits_processors": [], "vllm_xargs": {}, "store": False,
               "service_tier": "auto", "user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
               "metadata": {"a": "b"}, "request_id": "r"}
    params({**neutral, "best_of": 2, "n": 2, "add_special_tokens": True})
    params({**neutral, "add_special_tokens": False, "modalities": ["text"], "include_reasoning": True,
            "function_call": "none", "verbosity": "medium"}, chat=True)


def test_fields_of_neither_schema_are_ignored_with_one_warning_per_name(caplog):
    serving = BaseServing(None, "m", None)
    with caplog.at_level(logging.WARNING, logger="pdserve.server"):
        for _ in range(3):
            for body in ({"no_stop_trim": True, "return_hidden_states": False}, {"no_stop_trim": False}):
                req = CompletionRequest(prompt="x", **body)
                assert serving.sampling_params(req, 4, None).max_tokens == 4
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and any("no_stop_trim" in w for w in warned) \
        and any("return_hidden_states" in w for w in warned)


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_logprobs_are_refused_in_a_stream(chat):
    """vLLM's rule: a stream has no place for them (0, asking for none, passes)."""
    with pytest.raises(InvalidRequestError) as e:
        params({"stream": True, "prompt_logprobs": 2}, chat)
    assert e.value.field == "prompt_logprobs" and "stream" in str(e.value)
    assert params({"stream": True, "prompt_logprobs": 0}, chat).prompt_logprobs == 0
    assert params({"prompt_logprobs": 2}, chat).prompt_logprobs == 2
