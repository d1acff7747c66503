"""OpenAI-compatible request and response bodies (pydantic), in vLLM's shape.

Server process, HTTP edge. Parsing only: turning a request into engine inputs is serving.py's job.
Wrong types are a 400 that names the field. Fields of vLLM's or OpenAI's schemas pdserve does not
implement are declared with the values that change nothing (`NEUTRAL`); any other value is a 400
naming the field (`refused_field`). Fields of neither schema are ignored, as vLLM ignores them, and
logged once per name (`unknown_fields`): routers add their own (docs/design.md, "Request fields").
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept aside (model_extra) to be logged, never used

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM extension: token ids of each choice in the response
    cache_salt: str | None = None  # vLLM: prefix-cache blocks are shared only with the same salt
    prompt_logprobs: int | None = None  # vLLM: top-n logprobs of each prompt token
    # logits controls, in vLLM's semantics (worker/logits_controls.py)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # vLLM's chat field; completions take it too
    request_id: str | None = Field(None, max_length=256)  # vLLM: the response's id without X-Request-Id
    # identifiers that change nothing in the answer (OpenAI's; `user` above is one too)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache matches by content, whatever the key
    metadata: dict[str, Any] | None = None
    truncate_prompt_tokens: Any = None  # vLLM's: keep the prompt's last k tokens (-1: the context's length)
    # not implemented: accepted only at the values in NEUTRAL
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    spaces_between_special_tokens: Any = True
    priority: Any = 0
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    store: Any = None
    service_tier: Any = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "use_beam_search": (False,), "length_penalty": (1.0,), "spaces_between_special_tokens": (True,),
        "priority": (0,), "logits_processors": (None, []),
        "return_tokens_as_token_ids": (None, False), "vllm_xargs": (None, {}), "mm_processor_kwargs": (None, {}),
        "store": (None, False), "service_tier": (None, "auto", "default")}
    # structured outputs (server/structured.py): at most one of these
    response_format: "ResponseFormat | None" = None
    structured_outputs: "StructuredOutputsParams | None" = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: str  # text, json_object, json_schema
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False  # pdserve's JSON is always compact (docs/design.md)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    max_completion_tokens: int | None = None  # vLLM accepts it here too; it wins over max_tokens
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Any = None  # neutral: unset, or n
    prompt_embeds: Any = None
    add_special_tokens: Any = True

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_Request.NEUTRAL, "prompt_embeds": (None,),
                                           "add_special_tokens": (True,)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: continue the last (assistant) message
    chat_template: str | None = None  # vLLM: a template of the request's own (or a named one)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra variables for the template
    tools: list[dict[str, Any]] | None = None  # server/tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: Any = False
    documents: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = True
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    echo: Any = False  # vLLM's chat echo (the last message of the same role first): not implemented

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_Request.NEUTRAL, "add_special_tokens": (False,), "documents": (None,), "reasoning_effort": (None,),
        "include_reasoning": (True,), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
        "web_search_options": (None,), "functions": (None,), "function_call": (None, "none"),
        "verbosity": (None, "medium"), "echo": (False,)}


def refused_field(req: _Request) -> str | None:
    """The first field set to a value pdserve does not implement (`NEUTRAL`), or None."""
    for name, neutral in req.NEUTRAL.items():
        value = getattr(req, name)
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
            return name
    best_of = getattr(req, "best_of", None)
    return "best_of" if best_of is not None and best_of != req.n else None


def unknown_fields(req: _Request) -> list[str]:
    """Fields of neither vLLM's nor OpenAI's schema (a router's own, e.g. vllm-router's
    `no_stop_trim`): ignored."""
    return sorted(req.model_extra or ())


# --- responses ----------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids
    prompt_logprobs: list[dict[str, "PromptLogprob"] | None] | None = None  # vLLM: token id -> entry


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
